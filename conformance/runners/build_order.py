"""The order a user's loop builds its model, optimizer and wrapper in, and resumes a checkpoint in.

Users write these steps in several orders, and torch DDP trains the same in each of them
(torch/nn/parallel/distributed.py): DDP keeps the module's own Parameter objects (it registers
none of its own, it reduces into `module.parameters()`), so an optimizer built over the module
before wrapping steps the very parameters DDP reduces into; a state dict loaded into the module
before wrapping is what the construction broadcast sends; and an optimizer's state may be loaded
any time before the step that uses it. An engine that works only in the order a catalogue
happens to use passes every other check (an engine that re-registers the parameters at
construction leaves such an optimizer stepping orphans), so the scenario space makes the orders
dimensions (issue 38). Every order trains the same: the oracle is the same for all of them.

Construction, the `model_kwargs` loop switch ``build_order`` (a loop switch: the model ignores it):

    wrap-first       model -> wrapper -> optimizer over the wrapper's parameters (the default)
    optimizer-first  model -> optimizer over the module's parameters -> wrapper

A checkpoint round trip rebuilds in the same construction order, and loads where the feature
``resume_order`` says (`conformance.features`):

    wrap-load        after wrapping: the wrapper's state dict (torch DDP's ``module.`` keys), then
                     the optimizer's state right after the optimizer is built (the default)
    load-wrap        before wrapping: the module's state dict (the prefix stripped, as torch's
                     ``consume_prefix_in_state_dict_if_present`` does), into the bare module
    optimizer-late   as wrap-load, but the optimizer's state is loaded after the resumed run's
                     first backward, just before its first step
"""

from __future__ import annotations

from torch import nn

BUILD_ORDERS = ("wrap-first", "optimizer-first")
RESUME_ORDERS = ("wrap-load", "load-wrap", "optimizer-late")
_PREFIXES = ("module.", "_orig_mod.")  # torch DDP's, and torch.compile's OptimizedModule's


def build_order(scenario) -> str:
    """The scenario's construction order (ValueError, one line, for an unknown one)."""
    order = scenario.kwargs().get("build_order", BUILD_ORDERS[0])
    if order not in BUILD_ORDERS:
        raise ValueError(f"scenario {scenario.id}: build_order {order!r} is not one of {', '.join(BUILD_ORDERS)}")
    return order


def resume_order(feats) -> str:
    order = feats.resume_order or RESUME_ORDERS[0]
    if order not in RESUME_ORDERS:
        raise ValueError(f"resume_order {order!r} is not one of {', '.join(RESUME_ORDERS)}")
    return order


def optimizer_first(scenario, owns: frozenset) -> bool:
    """Whether the user's optimizer is built before wrapping (never for an engine that owns it)."""
    return build_order(scenario) == "optimizer-first" and "optimizer" not in owns


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """What the user hands the optimizer: the module's parameters that require grad, in order
    (the same list, in the same order, as `Wrapped.optimizer_parameters()` of a DDP-like wrapper)."""
    return [p for p in module.parameters() if p.requires_grad]


def module_state(wrapper_state: dict) -> dict:
    """A wrapper's state dict as the bare module's: the ``module.`` prefix stripped (and
    torch.compile's ``_orig_mod.``), keys in the same order."""
    out = {}
    for key, value in wrapper_state.items():
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix):]
        out[key] = value
    return out
