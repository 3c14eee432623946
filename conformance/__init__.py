"""gradparity conformance suite: proves a data-parallel implementation trains like one process."""

__version__ = "0.1.0"
