"""tether's version (a leaf: every module may import it, and `tether.__version__` re-exports it)."""

__version__ = "0.1.0"
