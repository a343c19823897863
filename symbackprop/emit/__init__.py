"""Emit: C source through the Jinja templates in templates/, the
derivation file and the grad_fn graph."""
