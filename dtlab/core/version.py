"""The package version, in one place (``dtlab.__version__`` and each result's provenance read it)."""

__version__ = "0.1.0"
