"""Schedule: kernels (kernel.py), fusion, CSE, names and the workspace of
each function (scheduler.py drives them)."""
