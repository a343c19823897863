"""Side-by-side benchmark harness for symbackprop (see benchmarks/README.md)."""
