"""IR: graph nodes (node.py), their constructors (construct.py), the lowering
from SymPy (lower.py), and a numpy interpreter of the IR (interpret.py)."""
