"""The op families of the tensor IR, one record per op (OpRecord, in
symbackprop.base.registry): elementwise, matmul, reduce, cumulative, views,
emap, linalg, conv, attention, pick, normalize; scan's in symbackprop.loops.
A family builds on the stages before it (ir, diff, schedule, emit) and
registers its records; those stages look the records up by tag at call
time, and the registry imports the families on the first look-up."""
