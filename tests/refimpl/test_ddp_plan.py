"""Unit tests of the pure bucket planner (no process group)."""

import pytest
import torch

from refimpl.ddp.plan import (
    ParamInfo,
    compute_bucket_assignment_by_size,
    plan_buckets,
)

MiB = 1024 * 1024
CPU = torch.device("cpu")


def f32(numel):
    return ParamInfo((numel,), torch.float32, CPU)


def test_reverse_order_and_first_bucket_is_small():
    # 8 params of 0.5 MiB each: first bucket closes at 1 MiB (2 params), then 2 MiB cap.
    params = [f32(MiB // 8) for _ in range(8)]
    plan = plan_buckets(params, bucket_cap_bytes=2 * MiB)
    assert [b.param_indices for b in plan] == [(7, 6), (5, 4, 3, 2), (1, 0)]
    assert [b.size_limit for b in plan] == [MiB, 2 * MiB, 2 * MiB]
    assert plan[1].offsets == (0, MiB // 8, MiB // 4, 3 * MiB // 8)
    assert plan[1].numel == MiB // 2 and plan[1].nbytes == 2 * MiB


def test_bucket_closes_when_limit_reached_and_may_overshoot():
    params = [f32(10), f32(MiB), f32(10)]  # the 4 MiB param overshoots the 1 MiB limit
    groups = compute_bucket_assignment_by_size(params, [MiB, 25 * MiB])
    assert groups == [([2, 1], MiB), ([0], 25 * MiB)]


def test_split_by_dtype_and_device():
    params = [
        f32(4),
        ParamInfo((4,), torch.float16, CPU),
        f32(4),
        ParamInfo((2, 2), torch.bfloat16, CPU),
        ParamInfo((4,), torch.float32, torch.device("meta")),
    ]
    plan = plan_buckets(params)
    by_key = {(b.dtype, b.device.type): b.param_indices for b in plan}
    assert by_key == {
        (torch.float32, "meta"): (4,),
        (torch.bfloat16, "cpu"): (3,),
        (torch.float32, "cpu"): (2, 0),
        (torch.float16, "cpu"): (1,),
    }
    # Buckets are numbered by the position of their first parameter (reverse order).
    assert [b.param_indices[0] for b in plan] == [4, 3, 2, 1]
    assert [b.index for b in plan] == [0, 1, 2, 3]
    assert plan[1].shapes == ((2, 2),)


def test_first_bucket_limit_is_per_dtype_stream():
    params = [ParamInfo((MiB // 2,), torch.float16, CPU), f32(MiB // 4), f32(MiB // 4)]
    plan = plan_buckets(params, bucket_cap_bytes=25 * MiB)
    # fp32 stream: 2 * 1 MiB -> first bucket closes after the first param (1 MiB reached)
    assert [b.param_indices for b in plan] == [(2,), (1,), (0,)]
    assert [b.size_limit for b in plan] == [MiB, 25 * MiB, MiB]


def test_sparse_params_get_their_own_bucket():
    params = [f32(4), f32(4), f32(4)]
    plan = plan_buckets(params, expect_sparse_gradient=[False, True, False])
    assert [(b.param_indices, b.sparse) for b in plan] == [((2, 0), False), ((1,), True)]
    sparse = [b for b in plan if b.sparse]
    assert len(sparse) == 1 and sparse[0].param_indices == (1,)
    dense = [i for b in plan if not b.sparse for i in b.param_indices]
    assert sorted(dense) == [0, 2]


def test_explicit_order_is_kept_within_buckets():
    params = [f32(4) for _ in range(5)]
    plan = plan_buckets(params, order=[2, 0, 4, 1, 3])
    assert [b.param_indices for b in plan] == [(2, 0, 4, 1, 3)]


def test_bad_order_rejected():
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets([f32(1), f32(1)], order=[0, 0])


def test_param_info_from_tensor_and_zero_sized():
    t = torch.zeros(3, 5, dtype=torch.float64)
    info = ParamInfo.of(t)
    assert info.numel == 15 and info.nbytes == 120 and info.dtype == torch.float64
    plan = plan_buckets([t, torch.zeros(0)])
    assert {b.numel for b in plan} == {15, 0}


def test_plans_are_frozen_plain_data():
    plan = plan_buckets([f32(4)])
    with pytest.raises(AttributeError):
        plan[0].numel = 3  # type: ignore[misc]
    import pickle

    assert pickle.loads(pickle.dumps(plan)) == plan
