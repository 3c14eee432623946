"""Each torch private in refimpl/_torch_compat.py exists on this torch and behaves as used.

A torch upgrade that renames or changes one fails here, by name, instead of in a distant
scenario. The FSDP and composable-replicate pins run in an in-process gloo world of 1.
"""

from __future__ import annotations

import re
import sys
import tokenize
from pathlib import Path

import pytest
import torch
from torch import nn

from refimpl import _torch_compat as compat


def test_queue_backward_callback_runs_once_when_backward_has_finished():
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    seen = []

    def at_end():
        seen.append((a.grad is not None, b.grad is not None))

    queued = []

    def hook(_param):
        if not queued:
            queued.append(True)
            compat.queue_backward_callback(at_end)

    a.register_post_accumulate_grad_hook(hook)
    b.register_post_accumulate_grad_hook(hook)
    ((a * 2).sum() + (b * 3).sum()).backward()
    assert seen == [(True, True)]  # once, after every leaf's gradient was accumulated


def test_queue_backward_callback_outside_backward_is_refused():
    with pytest.raises(RuntimeError):
        compat.queue_backward_callback(lambda: None)


def test_flatten_dense_puts_values_back_to_back_and_resolves_lazy_bits_when_it_copies():
    a, b = torch.arange(6.0).view(2, 3), torch.arange(4.0)[::2]  # contiguous, non-contiguous
    flat = compat.flatten_dense([a, b, torch.tensor(7.0)])
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 0, 2, 7]
    z = torch.tensor([1 + 2j, 3 - 1j])
    assert not compat.flatten_dense([z.conj(), z]).is_conj()
    assert torch.equal(compat.flatten_dense([z.conj(), z])[:2], z.conj().resolve_conj())
    assert not compat.flatten_dense([z.conj().imag, b]).is_neg()
    # a single contiguous tensor comes back as a view, its lazy bits kept (the caller resolves)
    assert compat.flatten_dense([z.conj()]).is_conj()


def test_autograd_tls_follows_the_backward_and_is_removed():
    key = "refimpl-compat-test"
    assert not compat.autograd_tls_has(key)
    seen = []
    leaf = torch.ones(2, requires_grad=True)
    leaf.register_hook(lambda g: seen.append(compat.autograd_tls_get(key) if compat.autograd_tls_has(key) else None))
    marker = object()
    compat.autograd_tls_stash(key, marker)
    try:
        (leaf * 3).sum().backward()
    finally:
        compat.autograd_tls_remove(key)
    assert seen == [marker] and not compat.autograd_tls_has(key)


def test_engine_run_backward_accumulates_like_backward():
    a = torch.tensor([1.0, 2.0], requires_grad=True)
    out = (a * a).sum()
    compat.engine_run_backward((out,), (torch.ones(()),), False, False, (), allow_unreachable=True, accumulate_grad=True)
    assert torch.equal(a.grad, torch.tensor([2.0, 4.0]))


def test_profiler_enabled_tells_whether_the_profiler_records():
    assert not compat.profiler_enabled()
    with torch.autograd.profiler.profile():
        assert compat.profiler_enabled()
    assert not compat.profiler_enabled()


def test_sparse_values_reads_uncoalesced_tensors():
    t = torch.sparse_coo_tensor([[0, 0, 2]], [1.0, 2.0, 3.0], (3,))
    assert not t.is_coalesced()
    assert torch.equal(compat.sparse_values(t), torch.tensor([1.0, 2.0, 3.0]))


def test_rref_class_is_the_base_of_rpc_rref_and_has_to_here():
    from torch.distributed import rpc

    cls = compat.rref_class()
    assert issubclass(rpc.RRef, cls) and callable(cls.to_here)


def test_hook_dict_is_the_dict_autograd_runs_pre_hooks_from_in_insertion_order():
    t = torch.rand(2, requires_grad=True)
    node = (t * 2).grad_fn.next_functions[0][0]
    order = []
    first = node.register_prehook(lambda g: order.append("first"))
    second = node.register_prehook(lambda g: order.append("second"))
    hooks = compat.hook_dict(first)
    assert hooks is compat.hook_dict(second) and list(hooks) == [first.id, second.id]
    hooks[first.id] = hooks.pop(first.id)  # re-inserted: now last
    (t * 2).sum().backward()  # through the same AccumulateGrad node
    assert order == ["second", "first"]


_AGENT_CHECK = """
import sys
import pytest
from torch.distributed import rpc
from refimpl import _torch_compat as compat
with pytest.raises(RuntimeError):
    compat.current_rpc_agent()
options = rpc.TensorPipeRpcBackendOptions(init_method="file://" + sys.argv[1], _transports=["uv"])
rpc.init_rpc("solo", rank=0, world_size=1, rpc_backend_options=options)
agent = compat.current_rpc_agent()
assert agent is compat.current_rpc_agent() and agent.get_worker_info().name == "solo"
get_agent = compat.current_rpc_agent_function()  # bound once, asked per message
assert get_agent() is agent
rpc.shutdown()
with pytest.raises(RuntimeError):
    compat.current_rpc_agent()
with pytest.raises(RuntimeError):
    get_agent()
print("ok")
"""


def test_current_rpc_agent_is_one_object_per_agent_and_raises_without_one(tmp_path):
    # In a process of its own: initializing RPC here would leave torch's distributed autograd
    # initialized for the rest of this test process.
    import os
    import subprocess

    env = {**os.environ, "TP_SOCKET_IFNAME": "lo"}
    done = subprocess.run(
        [sys.executable, "-c", _AGENT_CHECK, str(tmp_path / "store")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_find_script_function_by_qualified_name():
    @torch.jit.script
    def plus_one(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    found = compat.find_script_function(plus_one.qualified_name)
    assert found is not None and torch.equal(found(torch.zeros(1)), torch.ones(1))
    assert compat.find_script_function("no.such.function") is None


def test_foreach_copy_copies_each_pair():
    dst = [torch.zeros(2, 3), torch.zeros(4)]
    src = [torch.arange(6.0).view(2, 3), torch.full((4,), 7.0)]
    compat.foreach_copy_(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert dst[0].data_ptr() != src[0].data_ptr()


def test_module_slot_names_are_the_live_registries():
    bn = nn.Sequential(nn.BatchNorm1d(3))
    inner = bn[0]
    slots = vars(inner)
    assert set(slots[compat.MODULE_PARAMETERS]) == {"weight", "bias"}
    assert {"running_mean", "running_var"} <= set(slots[compat.MODULE_BUFFERS])
    assert vars(bn)[compat.MODULE_CHILDREN]["0"] is inner
    # Writing the dicts is what replicate does: the module's accessors must see it.
    extra = torch.zeros(1)
    slots[compat.MODULE_BUFFERS]["extra"] = extra
    assert dict(inner.named_buffers())["extra"] is extra


def test_ddp_mixed_precision_carries_only_the_reduce_dtype():
    mp = compat.ddp_mixed_precision(torch.bfloat16)
    assert (mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype) == (None, torch.bfloat16, None)
    from refimpl.ddp.mixed_precision import reduce_precision_hook

    assert reduce_precision_hook(mp, [torch.zeros(1)]) is not None  # refimpl reads the same object


def test_dist_autograd_debug_info_exists_and_needs_an_initialized_rpc():
    import torch.distributed.autograd as dist_autograd

    assert callable(dist_autograd._get_debug_info)
    with pytest.raises(RuntimeError, match="initialize distributed autograd"):
        compat.dist_autograd_debug_info()


def test_composable_fully_shard_resolves():
    fully_shard = compat.composable_fully_shard()
    assert callable(fully_shard) and fully_shard.__name__ == "fully_shard"


def test_composable_replicate_wraps_a_module_that_trains(world1):
    replicate = compat.composable_replicate()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ref = nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    replicate(model, process_group=world1)
    x = torch.randn(4, 3)
    model(x).sum().backward()
    ref(x).sum().backward()
    assert torch.equal(model.weight.grad, ref.weight.grad)


def test_fsdp_flat_param_and_unflat_views(world1):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    fsdp = FSDP(model, process_group=world1, device_id=torch.device("cpu"), use_orig_params=True)
    flat = compat.fsdp_flat_param(fsdp)
    assert flat.numel() == sum(s.numel() for s in shapes.values())
    views = compat.fsdp_unflat_views(fsdp, torch.arange(flat.numel(), dtype=torch.float32))
    assert {n: v.shape for n, v in views.items()} == shapes
    assert torch.equal(torch.cat([v.reshape(-1) for v in views.values()]), torch.arange(flat.numel(), dtype=torch.float32))


# A torch private in code (not in a docstring or comment): `torch._x`, `dist._x`, a private
# submodule (`torch.distributed._composable`), or a private attribute of a torch object
# reached under a torch-ish name.
_PRIVATE = re.compile(
    r"\b(torch|dist|da|dist_autograd|rpc|fsdp|FSDP)\s*\.\s*_[A-Za-z]\w*"
    r"|\btorch(\s*\.\s*\w+)*\s*\.\s*_[a-z]\w*"
    r"|\bfrom\s+torch(\s*\.\s*\w+)*\s+import\s+[^\n]*?\b_[A-Za-z]\w*"
    # private members of torch objects that any variable name may hold (not self's own):
    r"|(?<!\bself )(?<!\bcls )\.\s*(_execution_engine|_foreach_\w+|_get_fsdp_state|_fsdp_param_group|_handle|_get_unflat_views|_fqns"
    r"|_values|_indices|_parameters|_buffers|_modules|_get_debug_info|_get_ddp_logging_data|_MixedPrecision"
    r"|_reduce_scatter_base|_all_gather_base|_set_static_graph|_composable)\b"
)
_PENDING: tuple[str, ...] = ()  # directories whose privates have not moved yet (none)


def _code_only(path: Path) -> str:
    """The file's source with strings and comments blanked out."""
    out = []
    with path.open("rb") as fh:
        for tok in tokenize.tokenize(fh.readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT, tokenize.ENCODING):
                continue
            if sys.version_info >= (3, 12) and tok.type in (tokenize.FSTRING_START, tokenize.FSTRING_MIDDLE,
                                                            tokenize.FSTRING_END):
                continue
            out.append(tok.string)
    return " ".join(out)


def test_no_torch_private_outside_the_compat_module():
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for pkg in ("refimpl", "conformance"):
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in ("refimpl/_torch_compat.py", "refimpl/_torch_features.py") or (_PENDING and rel.startswith(_PENDING)):
                continue
            for m in _PRIVATE.finditer(_code_only(path)):
                offenders.append(f"{rel}: {m.group(0)}")
    assert not offenders, "torch privates outside refimpl/_torch_compat.py:\n" + "\n".join(offenders)


def test_the_private_pattern_catches_what_it_must():
    for code in ("torch.autograd.Variable._execution_engine.queue_callback(f)", "torch._foreach_copy_(a, b)",
                 "dist._x()", "m._parameters.values()", "g._values()", "s = m._get_fsdp_state()",
                 "from torch.autograd.graph import GradientEdge, _engine_run_backward",
                 "from torch.nn.parallel.distributed import _MixedPrecision"):
        assert _PRIVATE.search(code), code
    for code in ("torch.autograd.grad(x); dist.all_reduce(t); self._state; ddp._check_joinable()",
                 "from torch.autograd.graph import GradientEdge\nx = _local_name"):
        assert not _PRIVATE.search(code), code


def test_node_hooks_seen_watches_node_hooks_only():
    """A pre-hook or post hook on a C++ or Python autograd node flips the watch, for good; a
    tensor hook does not (a fresh process: the watch is process-wide)."""
    import subprocess
    import sys

    code = """
import torch
from refimpl._torch_compat import node_hooks_seen
t = torch.ones(2, requires_grad=True)
t.register_hook(lambda g: g)
t.register_post_accumulate_grad_hook(lambda p: None)
(t * 2).register_hook(lambda g: g)
assert not node_hooks_seen()
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1
    @staticmethod
    def backward(ctx, g):
        return g
handle = F.apply(t).grad_fn.register_prehook(lambda g: None)
assert node_hooks_seen()
handle.remove()
assert node_hooks_seen()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_functional_optimizer_steps_as_its_class_bitwise():
    """The functional twin of SGD (momentum, weight decay) and of Adam make the very updates of
    their classes; a class without a twin has none."""
    for cls, kwargs in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
                        (torch.optim.Adam, {"lr": 0.01})):
        twin = compat.functional_optimizer(cls)
        assert twin is not None
        a = [torch.randn(4, 3), torch.randn(3)]
        b = [t.clone() for t in a]
        for t in a:
            t.requires_grad_()
        cls_opt = cls(a, **kwargs)
        fn_opt = twin(b, **kwargs)
        for step in range(3):
            grads = [torch.randn(4, 3), torch.randn(3)]
            for t, g in zip(a, grads, strict=True):
                t.grad = g
            cls_opt.step()
            fn_opt.step(grads)
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x.detach(), y), (cls.__name__, step)
    assert compat.functional_optimizer(type("Custom", (torch.optim.SGD,), {})) is None
