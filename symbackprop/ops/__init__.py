"""The ops of the tensor IR, one record each (registry.py: OpRecord; one
module a family: elementwise, matmul, reduce, cumulative, views, emap; scan's
in symbackprop.loops); scalar functions (sigmoid, polygamma, ...) one record
each in functions.py. The registry imports no stage: the families build on
the stages and are imported on the first look-up."""
