"""Tools for reviewing a change to a model: what changed in its math
(mathdiff.py), read from model files or from a git revision (revisions.py)."""
