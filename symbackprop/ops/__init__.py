"""The ops of the tensor IR, one record each (see registry.py);
scalar functions (sigmoid, polygamma, ...) one record each in functions.py.

This package imports only its registry here: the family modules build on
the stages (ir, schedule, codegen) and are imported on the first look-up.
"""

from .registry import MissingRule, OpRecord, ViewRule, extend, is_view, record, records, reductions, register, rule

__all__ = ["MissingRule", "OpRecord", "ViewRule", "extend", "is_view", "record", "records", "reductions", "register", "rule"]
