"""Adapters of the `bucketer` area: bucketed reduce-scatter.

The protocol (FairScale's `ReduceScatterBucketer` interface)::

    class BucketerAdapter(Protocol):
        name: str
        version: str
        area = "bucketer"
        capabilities: frozenset[Capability]     # BUCKET_CAP, HALF_PRECISION
        def make(self, bucket_cap_mb: float | None) -> Bucketer: ...   # None: its default
        def unavailable(self, scenario) -> str | None: ...             # optional

    class Bucketer(Protocol):
        def reduce_scatter_async(self, input_list, group, callback_fn=None) -> None: ...
        def flush(self) -> None: ...
        def teardown(self) -> None: ...        # optional: called after each round's flush

Built-ins: ``refimpl-bucketer`` and ``fairscale-bucketer`` (FairScale 0.4.13, an optional
extra: ``pip install 'gradparity[fairscale]'`` or ``pip install fairscale==0.4.13 --no-deps``;
when it cannot be imported every scenario is skipped with the import error).
Known-bad bucketers live in the zoo: `conformance.mutants.bucketer`.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Protocol

from conformance.spec import Capability, Scenario

C = Capability


class BucketerAdapter(Protocol):
    name: str
    version: str
    area: str
    capabilities: frozenset[Capability]

    def make(self, bucket_cap_mb: float | None) -> Any: ...


class RefimplBucketer:
    name = "refimpl-bucketer"
    area = "bucketer"
    capabilities = frozenset({C.BUCKET_CAP, C.HALF_PRECISION})

    def __init__(self):
        import refimpl

        self.version = getattr(refimpl, "__version__", "0")

    def make(self, bucket_cap_mb: float | None):
        from refimpl.sharded.bucketer import ReduceScatterBucketer

        return ReduceScatterBucketer() if bucket_cap_mb is None else ReduceScatterBucketer(bucket_cap_mb)


@functools.cache
def _import_fairscale() -> tuple[Any, str | None, str | None]:
    """(class, version, None) or (None, None, why it cannot be used).

    FairScale calls the private ``dist._reduce_scatter_base`` with a 2-D input unless
    ``ENABLE_NCCL_BASE_COLLECTIVES=0`` is set before its import; gloo rejects that input
    ("outputShape[0] * worldSize == inputShape[0]"), so the switch is set here (FairScale then
    uses the public list form ``dist.reduce_scatter``, which gloo and NCCL both run).
    """
    os.environ.setdefault("ENABLE_NCCL_BASE_COLLECTIVES", "0")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import fairscale

            try:
                from fairscale.internal.reduce_scatter_bucketer import ReduceScatterBucketer
            except ImportError:  # fairscale < 0.4.6
                from fairscale.utils.reduce_scatter_bucketer import ReduceScatterBucketer
    except Exception as exc:  # noqa: BLE001 - any import failure becomes the skip reason
        return None, None, f"fairscale cannot be imported ({type(exc).__name__}: {exc}); pip install fairscale==0.4.13 --no-deps"
    return ReduceScatterBucketer, getattr(fairscale, "__version__", "unknown"), None


class FairScaleBucketer:
    name = "fairscale-bucketer"
    area = "bucketer"
    capabilities = frozenset({C.BUCKET_CAP, C.HALF_PRECISION})

    def __init__(self):
        self.version = _import_fairscale()[1] or "not installed"

    def unavailable(self, scenario: Scenario | None = None) -> str | None:
        return _import_fairscale()[2]

    def make(self, bucket_cap_mb: float | None):
        cls, _, why = _import_fairscale()
        if cls is None:
            raise RuntimeError(why)
        with warnings.catch_warnings():  # its setup() uses the deprecated TypedStorage API
            warnings.simplefilter("ignore")
            return _Quiet(cls() if bucket_cap_mb is None else cls(bucket_cap_mb))


class _Quiet:
    """Silences FairScale's TypedStorage deprecation warnings (one per bucket setup)."""

    def __init__(self, inner):
        self.inner = inner

    def reduce_scatter_async(self, input_list, group, callback_fn=None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.inner.reduce_scatter_async(input_list, group, callback_fn)

    def flush(self):
        self.inner.flush()

    def teardown(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.inner.teardown()


def refimpl_bucketer() -> RefimplBucketer:
    return RefimplBucketer()


def fairscale_bucketer() -> FairScaleBucketer:
    return FairScaleBucketer()
