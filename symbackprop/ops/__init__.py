"""The ops of symbackprop, one record each: scalar functions in functions.py."""
