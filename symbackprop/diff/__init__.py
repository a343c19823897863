"""Differentiate: reverse (VJP) and forward (JVP) mode over the IR; the
rules live in each op's record (symbackprop.ops)."""
