"""This release's version: the package metadata's (``pyproject.toml`` reads it here),
``rallypoint.__version__`` and ``rallypoint --version``."""

__all__ = ["__version__"]

__version__ = "0.1.0"
