"""Loops whose step is declared in SymPy and run as a C loop: `scan`, a
recurrence over a sequence, and `fixed_point`, a loop that stops on a
condition (a scan without sequences). One module per stage (declare,
lower, diff, kernels, emit; fixpoint, fixpoint_lower and implicit for the
fixed point), hooked into the stages by register.py alone, which the op
registry imports on its first look-up. Guides: docs/scan.md, docs/fixed_point.md.
"""
