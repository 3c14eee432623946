"""Deprecated: moved to `refimpl.ddp.unused_params` (refimpl 0.2.0); this path is removed in 0.3.0."""

from refimpl._deprecated import reexport

reexport(__name__, globals())
