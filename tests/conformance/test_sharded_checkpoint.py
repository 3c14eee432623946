"""conformance/runners/sharded_checkpoint.py and conformance/adapters/sharded_state.py without
processes: what they refuse. The round trips themselves run in the suite (`sharded/state-dict-*`,
all four sharded engines pass; `tests/conformance/test_sharded_families.py` shows a load that skips
the optimizer's state caught) and in `tests/refimpl/test_sharded_checkpoint.py`."""

import pytest

from conformance.adapters import sharded_state
from conformance.runners.sharded_checkpoint import round_trip


def test_an_unknown_state_dict_kind_is_refused():
    with pytest.raises(ValueError, match="unknown state-dict kind 'flat'"):
        sharded_state.refimpl_state(object(), "flat", None)
    with pytest.raises(ValueError, match="one of"):
        sharded_state.torch_load(object(), "flat", {}, None)


def test_a_wrapped_model_without_the_state_methods_is_refused_before_any_collective():
    class NoState:
        def checkpoint(self, kind, optimizer):
            return {}

    with pytest.raises(RuntimeError, match=r"Wrapped.load_checkpoint.*capability state_dict"):
        round_trip("sharded", ctx=None, wrapped=NoState(), optimizer=None, close=lambda w: None,
                   rebuild=lambda: (None, None))
