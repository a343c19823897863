"""Declare: the model language (Model, layers, tensors, the stable functions)."""
