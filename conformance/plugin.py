"""Deprecated: moved to `conformance.frontends.plugin` (gradparity 0.2.0); this path is removed in 0.3.0."""

from conformance._deprecated import reexport

reexport(__name__, globals())
