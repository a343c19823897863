"""The exceptions symbackprop raises; every one derives from SymbackpropError."""


class SymbackpropError(Exception):
    """Base of every error symbackprop raises on purpose."""


class ModelError(SymbackpropError, ValueError):
    """The declared model cannot be compiled (names the offending subexpression)."""


class ArgumentError(SymbackpropError, ValueError):
    """A call passed a missing, unknown or malformed array."""


class BuildError(SymbackpropError, RuntimeError):
    """The C compiler failed or could not be found (says where the log is)."""
