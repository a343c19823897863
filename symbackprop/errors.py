"""The exceptions symbackprop raises; every one derives from SymbackpropError."""

from symbackprop.messages import capped


class SymbackpropError(Exception):
    """Base of every error symbackprop raises on purpose."""


class ModelError(SymbackpropError, ValueError):
    """The declared model cannot be compiled (names the offending subexpression).

    Its message is kept to what a person reads: an over-long one (an
    expanded expression quoted whole) is cut in the middle.

    Args:
        *args: the message, as for any exception (then any other arguments).
    """

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (capped(args[0]), *args[1:])
        super().__init__(*args)


class ArgumentError(SymbackpropError, ValueError):
    """A call passed a missing, unknown or malformed array."""


class BuildError(SymbackpropError, RuntimeError):
    """The C compiler failed or could not be found (says where the log is)."""


class ToolMissing(SymbackpropError, RuntimeError):
    """An optional program symbackprop runs (Graphviz's `dot`) is not installed (says how to install it)."""


class GradientCheckError(SymbackpropError, AssertionError):
    """check_grads found a gradient that disagrees with central differences
    beyond the tolerance given (names the arguments)."""
