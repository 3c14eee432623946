"""Deprecated: moved to `refimpl.ddp.mixed_precision` (refimpl 0.2.0); this path is removed in 0.3.0."""

from refimpl._deprecated import reexport

reexport(__name__, globals())
