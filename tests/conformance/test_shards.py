"""conformance/judge/shards.py: the slice each rank must hold under each placement, and the check
failing on one wrong element of one rank's shard (and on padding that is not zero)."""

import pytest
import torch

from conformance.judge.compare import ConformanceError
from conformance.judge.shards import check_local_shards, expected_shard
from conformance.spec import Scenario


def test_flat_chunk_pads_the_last_rank_with_zeros():
    full = torch.arange(1.0, 8.0).view(7)
    assert expected_shard(full, "flat-chunk", 0, 3).tolist() == [1, 2, 3]
    assert expected_shard(full, "flat-chunk", 2, 3).tolist() == [7, 0, 0]


def test_dim0_chunk_is_torch_chunk_with_empty_ranks():
    full = torch.arange(6.0).view(3, 2)
    assert expected_shard(full, "dim0-chunk", 1, 4).tolist() == [[2, 3]]
    assert expected_shard(full, "dim0-chunk", 3, 4).shape == (0, 2)


def _records(grad_shard_rank1):
    full = torch.arange(1.0, 6.0)
    ev = {"kind": "backward", "step": 0, "micro": 0, "synced": True, "values": {"w": full}}
    shards = {0: torch.tensor([1.0, 2.0, 3.0]), 1: grad_shard_rank1}
    return {r: {"events": [dict(ev, shards={"w": {"placement": "flat-chunk", "param": None, "grad": shards[r]}})]}
            for r in (0, 1)}


def test_a_wrong_shard_or_dirty_padding_fails_and_the_right_one_passes():
    scenario = Scenario(id="sharded/meta/shards/w2/fp32", area="sharded", model="mlp", world_size=2)
    count, details = check_local_shards(scenario, "meta", _records(torch.tensor([4.0, 5.0, 0.0])), "repro")
    assert count == 2 and "bitwise" in details["local_shards"]
    with pytest.raises(ConformanceError, match="rank 1.*padding must be zero"):
        check_local_shards(scenario, "meta", _records(torch.tensor([4.0, 5.0, 1.0])), "repro")
    with pytest.raises(ConformanceError, match="rank 1"):
        check_local_shards(scenario, "meta", _records(torch.tensor([4.0, 6.0, 0.0])), "repro")


def test_dim1_chunk_and_the_placement_rule():
    from conformance.judge.shards import placement_dim

    full = torch.arange(12.0).view(3, 4)
    assert expected_shard(full, "dim1-chunk", 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    assert placement_dim("dim1-if-even", (17, 8), 4) == 1  # W divides dim 1
    assert placement_dim("dim1-if-even", (3, 17), 4) == 0  # it does not: FSDP2's default dim 0
    assert placement_dim("dim1-if-even", (17,), 2) == 0
    with pytest.raises(ValueError, match="unknown shard placement rule"):
        placement_dim("dim2", (4, 4), 2)


def _placed(placement: str, shard_of):
    full = torch.arange(8.0).view(2, 4)
    ev = {"kind": "step", "step": 0, "values": {"w": full}}
    return {r: {"events": [dict(ev, shards={"w": {"placement": placement, "param": shard_of(full, r), "grad": None}})]}
            for r in (0, 1)}


def test_a_shard_on_another_dim_than_the_placement_fn_asked_fails():
    from conformance.spec import WrapOptions

    scenario = Scenario(id="sharded/meta/placed/w2/fp32", area="sharded", model="mlp", world_size=2,
                        options=WrapOptions(shard_placement="dim1-if-even"))
    right = _placed("dim1-chunk", lambda full, r: torch.chunk(full, 2, dim=1)[r])
    assert check_local_shards(scenario, "meta", right, "repro")[0] == 2
    ignored = _placed("dim0-chunk", lambda full, r: torch.chunk(full, 2, dim=0)[r])  # right slice, wrong dim
    with pytest.raises(ConformanceError, match="ignored the placement function"):
        check_local_shards(scenario, "meta", ignored, "repro")
    with pytest.raises(ConformanceError, match="no rank exposes its shards"):
        check_local_shards(scenario, "meta", {0: {"events": []}, 1: {"events": []}}, "repro")


def test_declared_unspecified_parameter_padding_compares_the_real_elements_and_says_so():
    scenario = Scenario(id="sharded/meta/ds/w2/fp32", area="sharded", model="mlp", world_size=2)
    full = torch.arange(1.0, 4.0)  # 3 elements at w2: rank 1 holds [3, pad]

    def records(pad, key="param_padding"):
        ev = {"kind": "step", "step": 0, "values": {"b": full}}
        shard = {0: torch.tensor([1.0, 2.0]), 1: torch.tensor([3.0, pad])}
        return {r: {"events": [dict(ev, shards={"b": {"placement": "flat-chunk", "param": shard[r], "grad": None,
                                                      key: "unspecified"}})]} for r in (0, 1)}

    count, details = check_local_shards(scenario, "meta", records(1e-43), "repro")
    assert count == 2 and "b" in details["local_shards_declared"]
    with pytest.raises(ConformanceError, match="padding must be zero"):
        check_local_shards(scenario, "meta", records(1e-43, key="other"), "repro")
