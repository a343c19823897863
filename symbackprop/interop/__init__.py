"""Interop: PyTorch, JAX and Dask on top of compiled modules."""
