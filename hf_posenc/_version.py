"""The package version, in a module that imports nothing (so any module may read it without
climbing back up to the package ``__init__``)."""

__version__ = "0.1.0"
