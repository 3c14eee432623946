"""gradparity conformance suite: proves a data-parallel implementation trains like one process."""

from conformance._version import __version__  # noqa: F401 - the public version


def __getattr__(name: str):
    """`conformance.check_model` (the user's own model from Python), imported on first use."""
    if name == "check_model":
        from conformance.frontends.model_check import check_model

        return check_model
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
