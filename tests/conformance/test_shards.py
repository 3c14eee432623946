"""conformance/shards.py: the slice each rank must hold under each placement, and the check
failing on one wrong element of one rank's shard (and on padding that is not zero)."""

import pytest
import torch

from conformance.compare import ConformanceError
from conformance.shards import check_local_shards, expected_shard
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
