"""Which buffers each rank forwards from: the declared rule, read with the scenario's options.

torch DDP's own rule depends on two things the replay must follow (torch 2.13,
``torch/nn/parallel/distributed.py``):

- ``broadcast_buffers=False`` turns the buffer sync off at construction too: ``__init__`` passes
  ``broadcast_buffers=init_sync_buffers`` to ``_sync_module_states``, and ``init_sync_buffers`` is
  the ``broadcast_buffers`` argument (only the newer ``forward_sync_buffers`` keeps the
  construction sync). Every rank then keeps and updates its own buffers from the ones it built:
  the rule `Buffers.NEVER`, reached through an option rather than declared (`rule`).
- with it on, ``_pre_forward`` broadcasts rank 0's buffers only where ``_check_sync_bufs_pre_fwd()``
  holds, i.e. ``will_sync_module_buffers()``: ``require_forward_param_sync`` and buffers to sync.
  ``require_forward_param_sync`` is True after construction and is set by each forward's
  ``_post_forward``: True for a forward outside ``no_sync()``, False inside. So a forward
  broadcasts exactly when the forward before it ran outside ``no_sync()`` (`broadcasts`): in a
  step of M micro-batches (the first M - 1 inside ``no_sync()``, or with their forwards there and
  the backwards outside: the flag is the forward's) only the first forward broadcasts; the others
  start from the buffers the rank's own previous forward left (BatchNorm's running statistics
  differ per rank until the next step's first forward).

refimpl's wrapper follows both (``refimpl/ddp/wrapper.py``: ``_sync_buffers_this_forward``).

An engine that declares its buffers broadcast after backward reads the option as that broadcast's
switch: pytorch-pfn-extras' ``DistributedDataParallel`` syncs parameters and buffers in its
constructor whatever it is given and broadcasts buffers after backward only
``if self._broadcast_buffers`` (``pytorch_pfn_extras/nn/parallel/distributed.py``), so off it is
`Buffers.CONSTRUCTION_ONLY`.
"""

from __future__ import annotations

from conformance.semantics import Buffers


def rule(scenario, semantics) -> Buffers:
    """The buffer rule the oracle replays: the declared one, with ``broadcast_buffers=False`` turning
    its broadcasts off (torch DDP's: `Buffers.NEVER`, not even at construction; one after backward:
    `Buffers.CONSTRUCTION_ONLY`)."""
    declared = semantics.buffers
    if scenario.options.broadcast_buffers:
        return declared
    return _OFF.get(declared, declared)


_OFF = {Buffers.BEFORE_FORWARD: Buffers.NEVER, Buffers.AFTER_BACKWARD: Buffers.CONSTRUCTION_ONLY}


def broadcasts(micro: int) -> bool:
    """Whether the forward of micro-batch `micro` starts with rank 0's buffers under
    `Buffers.BEFORE_FORWARD`: only one that follows a forward outside ``no_sync()`` (a step's
    first; the step before ended with its synced forward, construction sets the flag)."""
    return micro == 0


def describe(scenario, semantics) -> str:
    """The rule in words, as failure messages name it."""
    effective = rule(scenario, semantics)
    if effective == Buffers.NEVER and semantics.buffers != Buffers.NEVER:
        return "broadcast_buffers=False: buffers never synchronized (not at construction either), each rank its own"
    if effective != semantics.buffers:
        return "broadcast_buffers=False: rank 0's buffers at construction, then each rank its own"
    return _WORDS[effective]


_WORDS = {
    Buffers.BEFORE_FORWARD: "rank 0's buffers are broadcast before each forward that follows one outside no_sync()",
    Buffers.NEVER: "declared: buffers are never synchronized, each rank keeps its own",
    Buffers.CONSTRUCTION_ONLY: "declared: rank 0's buffers at construction, then each rank its own",
    Buffers.AFTER_BACKWARD: "declared: rank 0's buffers are broadcast after each synced backward",
}
