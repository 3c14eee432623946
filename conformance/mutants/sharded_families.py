"""Known-bad engines for the sharded families of issue #26 part B (clauses S15-S18).

Registered into the sharded zoo (`conformance.mutants.sharded.MUTANTS`) by `register`, so they
load like the others (`--adapter conformance.mutants.sharded:<name with - as _>`). Two kinds:

* refimpl ZeRO-3 mutants (S15, S16), judged against the zoo's ZeRO-3 control ``correct3``;
* torch FSDP2 mutants (S17, S18): only FSDP2 offers ``CPUOffloadPolicy`` and
  ``shard_placement_fn`` here, so the bug sits in an FSDP2 integration, judged against
  ``correct_fsdp2`` (the built-in adapter plus a firing counter, nothing changed).

Each calls ``_fired()`` where its bug changed what the correct code would have done; the
wrapper's ``backward_stats()`` reports the count as ``mutation_fired``.
"""

from __future__ import annotations

import torch

from conformance.adapters import sharded_state
from conformance.adapters.sharded_fsdp2 import FSDP2Wrapped, TorchFSDP2, fsdp2_extra


# -- refimpl ZeRO-3 -----------------------------------------------------------------------------
class RegatherHookOnce:
    """S15: the regather-before-backward hook is registered once per unit per iteration.

    A unit resharded after forward registers a hook on its outputs that gathers it again
    before its backward. Keyed on the unit instead of on the forward call, the second forward
    of the same unit gets no hook, and its backward runs first (autograd goes in reverse) on
    the freed parameters. (The hook's registration is looked up on ``torch.autograd.graph`` at
    call time, so the bug swaps it for a no-op during that one call.)
    """

    def _post_forward(self, unit, module, args, output):
        if unit.root or not torch.is_grad_enabled():
            return super()._post_forward(unit, module, args, output)
        hooked = self.__dict__.setdefault("_hooked_units", set())
        graph, register = torch.autograd.graph, torch.autograd.graph.register_multi_grad_hook
        if id(unit) in hooked:
            self._fired()
            graph.register_multi_grad_hook = lambda *a, **k: None
        hooked.add(id(unit))
        try:
            return super()._post_forward(unit, module, args, output)
        finally:
            graph.register_multi_grad_hook = register

    def _end_of_backward(self):
        self.__dict__["_hooked_units"] = set()
        return super()._end_of_backward()


def _dcp_load_skips_optimizer(wrapped_base):
    """S16: the checkpoint load restores the model and forgets the optimizer's state (a resumed
    run restarts momentum / Adam's moments and step count from zero)."""

    class Wrapped(wrapped_base):
        def load_checkpoint(self, kind, state, optimizer):
            if optimizer is not None and state.get("optim", {}).get("state"):
                self.sdp._fired()
            sharded_state.refimpl_load(self.sdp, kind, state, None)

    return Wrapped


# -- torch FSDP2 --------------------------------------------------------------------------------
class _CountingFSDP2Wrapped(FSDP2Wrapped):
    fired = 0

    def backward_stats(self) -> dict:
        return {"mutation_fired": self.fired}


class CorrectFSDP2(TorchFSDP2):
    """The FSDP2 mutants' control: the built-in adapter's wrap, the counting wrapper."""

    name, version = "zoo-sharded-correct-fsdp2", "zoo"
    base = "conformance.mutants.sharded:correct_fsdp2"

    def wrap(self, module, ctx, options):
        wrapped = super().wrap(module, ctx, options)
        return _CountingFSDP2Wrapped(wrapped.module, rs_only=wrapped.rs_only)  # S21: set_requires_all_reduce

    def unavailable(self, scenario):
        """torch-fsdp2's recorded failures (its strict xfail list) are FSDP2's own, not a mutant's:
        the control and its mutants skip them, so the zoo judges them only where FSDP2 is right."""
        reason = _fsdp2_known().get(f"torch-fsdp2|{scenario.id}")
        return f"torch-fsdp2's recorded failure: {reason}" if reason else super().unavailable(scenario)


def _fsdp2_known() -> dict[str, str]:
    from conformance.expectations import builtin_xfails, read_expectations

    path = builtin_xfails("torch-fsdp2")
    return read_expectations(path) if path else {}


class OffloadOptimizerBeforeShard(CorrectFSDP2):
    """S17: with CPU offload the optimizer is built over the parameters as they were before
    ``fully_shard`` moved them into CPU shards: it steps tensors the model no longer uses."""

    def wrap(self, module, ctx, options):
        before = [p for p in module.parameters() if p.requires_grad]
        wrapped = super().wrap(module, ctx, options)
        if options.cpu_offload:
            wrapped.fired += 1
            wrapped.optimizer_parameters = lambda: before
        return wrapped


class PlacementFnIgnored(CorrectFSDP2):
    """S18: the integration accepts ``shard_placement_fn`` and never passes it on: every
    parameter is sharded on dim 0, whatever the function asked for."""

    def fully_shard_extra(self, options, ctx):
        extra = super().fully_shard_extra(options, ctx)
        extra.pop("shard_placement_fn", None)
        return extra

    def wrap(self, module, ctx, options):
        asked = fsdp2_extra(options, ctx).get("shard_placement_fn")
        moved = asked is not None and any(asked(p).dim != 0 for p in module.parameters())
        wrapped = super().wrap(module, ctx, options)
        wrapped.fired += int(moved)
        return wrapped


def register(mutants, zoo3, wrapped3, correct3) -> dict:
    """Add the S15-S18 mutants to `mutants` (the sharded zoo's Registry); returns the extra
    factories `conformance.mutants.sharded` exposes (the FSDP2 control)."""
    mutants.mutant("regather-hook-once", "S15",
                   "the regather-before-backward hook is registered once per unit per iteration: a unit's "
                   "second forward gets none, and its backward runs on freed parameters",
                   may_abort=True, adapter=zoo3)(RegatherHookOnce)  # torch raises: no record, no fired count

    def dcp_adapter(_):
        base = type(correct3())
        broken = _dcp_load_skips_optimizer(wrapped3)

        def wrap(self, module, ctx, options, optimizer=None):
            correct = base.wrap(self, module, ctx, options, optimizer)
            return broken(correct.sdp, correct.optimizer)

        return type("Zoo3_DcpLoadSkipsOptimizer", (base,), {"wrap": wrap})

    mutants.mutant("dcp-load-skips-optimizer", "S16",
                   "a checkpoint load restores the model but not the optimizer's state (momentum and Adam's "
                   "moments restart from zero after resuming)", adapter=dcp_adapter)(None)
    mutants.mutant("offload-optimizer-before-shard", "S17",
                   "with CPU offload the optimizer steps the parameters as they were before fully_shard "
                   "(not the CPU shards the model computes with)")(OffloadOptimizerBeforeShard)
    mutants.mutant("placement-fn-ignored", "S18",
                   "shard_placement_fn is accepted and never passed on: every parameter is sharded on dim 0")(
        PlacementFnIgnored)
    return {"correct_fsdp2": correct_fsdp2}


def correct_fsdp2() -> CorrectFSDP2:
    return CorrectFSDP2()
