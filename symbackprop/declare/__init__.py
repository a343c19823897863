"""Declare: the model language (Model, layers, tensors); the stable
functions it offers (sigmoid, softplus) are leaves in symbackprop.base."""
