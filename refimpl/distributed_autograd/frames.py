"""The channel's wire format: one frame per message (channel.py).

A frame is a fixed header, the layout of its tensors, a pickle of the message with every dense
CPU tensor left out (a slot number in its place), and one raw buffer per dtype holding those
tensors' bytes back to back. 100 small gradients cost one copy and one buffer, not 100 pickled
tensors (a tensor pickled the ordinary way goes through ``torch.save``: ~100 us to write and
~250 us to read here). Sparse tensors and tensors on other devices are pickled the ordinary
way; the engine keeps such messages off the channel anyway.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import math
import pickle
import struct
import threading

import torch

from .._torch_compat import flatten_dense

_HEADER = struct.Struct("!IQI")  # layout length, pickle length, number of raw buffers
_LENGTH = struct.Struct("!Q")
_EMPTY_ANSWER = 0xFFFFFFFF  # a header's layout length that marks an empty answer


def carries(tensors) -> bool:
    """Whether every tensor can travel on the channel as raw bytes: dense, on the CPU, neither
    quantized (its scale and zero point are not bytes of the tensor) nor nested."""
    return all(_plain(t) for t in tensors)


def _plain(t: torch.Tensor) -> bool:
    return t.is_cpu and t.layout is torch.strided and not t.is_quantized and not t.is_nested


def _tensor_slot(index: int) -> torch.Tensor:
    """Stands in a frame's pickle for the frame's ``index``-th tensor; :class:`_Unpickler`
    resolves it to the tensor (it is never called)."""
    raise RuntimeError("a channel frame must be read with channel.decode")


def _reduce_tensor(t: torch.Tensor):
    if not _plain(t):
        return t.__reduce_ex__(5)
    tensors = _encoding.tensors
    tensors.append(t)
    return _tensor_slot, (len(tensors) - 1,)


_encoding = threading.local()


class _DispatchTable(dict):
    """copyreg's reducers with the dense tensor's own on top. The pickler looks up every
    object's type in it (the built-in types excepted): a dict subclass keeps a hit in C, and a
    miss reads copyreg's table as it is then."""

    def __missing__(self, cls):
        return copyreg.dispatch_table[cls]


class _Pickler(pickle.Pickler):
    """Pickle that leaves dense CPU tensors out, as slots into the frame's tensor list (only
    tensors reach Python: ``dispatch_table``, not ``persistent_id``, which sees every object)."""

    dispatch_table = _DispatchTable({torch.Tensor: _reduce_tensor})


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list) -> None:
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module, name):
        if module == __name__ and name == "_tensor_slot":
            return self._tensors.__getitem__
        return super().find_class(module, name)


def encode(obj) -> tuple[list, list]:
    """``obj`` as a frame: (the pieces to write, in order; the tensors they borrow from).

    The layout names, per dtype, the slots its buffer holds and their shapes, in order.
    """
    tensors: list[torch.Tensor] = []
    out = io.BytesIO()
    _encoding.tensors = tensors
    try:
        _Pickler(out, protocol=5).dump(obj)
    finally:
        _encoding.tensors = None
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    flats, layout = [], []
    with torch.no_grad():
        for members in groups.values():
            parts = [tensors[i] for i in members]
            shapes = [tuple(part.shape) for part in parts]
            # Raw bytes ignore the lazy conjugate / negative bits: the values, resolved.
            flats.append(_flatten(parts, shapes).resolve_conj().resolve_neg())
            layout.append((members, shapes))
    meta = pickle.dumps(([f.dtype for f in flats], layout), protocol=5)
    if len(meta) >= _EMPTY_ANSWER:
        raise ValueError(f"a message with {len(tensors)} tensors is too large for one frame")
    body = out.getbuffer()
    views = [_bytes_of(f) for f in flats]
    head = _HEADER.pack(len(meta), len(body), len(views)) + b"".join(
        _LENGTH.pack(v.nbytes) for v in views
    )
    return [memoryview(head), memoryview(meta), body, *views], flats


def _flatten(parts: list, shapes: list) -> torch.Tensor:
    """The parts' values back to back, in one kernel where their shapes allow: gradients are
    often one shape, and often views (a sum's gradient is an expanded scalar), which
    ``flatten_dense`` would first copy one by one (100 expanded gradients: 184 us; ``cat``:
    21 us)."""
    if all(len(shape) == 1 for shape in shapes):
        return torch.cat(parts)
    if len(set(shapes)) == 1:
        return torch.stack(parts).reshape(-1)
    return flatten_dense(parts)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive them)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _read_exact(rfile, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = rfile.readinto(view[got:])
        if not k:
            raise ConnectionError("connection closed by peer (EOF)")
        got += k
    return buf


def encode_empty_answer(seq: int) -> tuple[list, list]:
    """The frame of the answer ``(seq, None, None)``: a header alone (most answers are empty:
    a gradient message's answer only says it was handled; no pickle to write or read)."""
    return [memoryview(_HEADER.pack(_EMPTY_ANSWER, seq, 0))], []


def decode(rfile):
    """Read one frame (see :func:`encode`) from a buffered reader: the object."""
    meta_len, body_len, count = _HEADER.unpack(_read_exact(rfile, _HEADER.size))
    if meta_len == _EMPTY_ANSWER:
        return body_len, None, None
    sizes = struct.unpack(f"!{count}Q", _read_exact(rfile, 8 * count)) if count else ()
    dtypes, layout = pickle.loads(_read_exact(rfile, meta_len))
    body = _read_exact(rfile, body_len)
    tensors: list = [None] * sum(len(members) for members, _ in layout)
    for dtype, n, (members, shapes) in zip(dtypes, sizes, layout, strict=True):
        data = _read_exact(rfile, n)
        flat = torch.frombuffer(data, dtype=dtype) if n else torch.empty(0, dtype=dtype)
        if len(set(shapes)) == 1:  # one shape: one view, cut along its first dimension
            parts = flat.view(len(shapes), *shapes[0]).unbind(0)
            for i, part in zip(members, parts, strict=True):
                tensors[i] = part
            continue
        parts = flat.split([math.prod(shape) for shape in shapes])
        for i, shape, part in zip(members, shapes, parts, strict=True):
            tensors[i] = part if len(shape) == 1 else part.view(shape)
    return _Unpickler(io.BytesIO(body), tensors).load()


