"""gradparity conformance suite: proves a data-parallel implementation trains like one process."""

__version__ = "0.2.0"
