"""GradBench's evals ported to symbackprop, JAX and PyTorch (see benchmarks/README.md,
section "GradBench ports"). One module per eval; `EVALS` names them in order."""

EVALS = ("lse", "llsq", "kmeans", "det", "gmm", "ba", "ht", "lstm", "ode", "saddle", "particle")
