"""Deprecated: moved to `conformance.frontends.torchrun` (gradparity 0.2.0); this path is removed in 0.3.0."""

from conformance._deprecated import reexport

reexport("conformance.harness.torchrun", globals())  # by name: `python -m conformance.harness.torchrun` runs this as __main__

if __name__ == "__main__":
    import sys

    sys.exit(main())  # noqa: F821 - `main` is copied from the new module by reexport
