"""The channel's wire format: one frame per message (channel.py).

A frame is a fixed header, the layout of its tensors, a pickle of the message with every dense
CPU tensor left out (a slot number in its place), and one raw buffer per dtype holding those
tensors' bytes back to back. 100 small gradients cost one copy and one buffer, not 100 pickled
tensors (a tensor pickled the ordinary way goes through ``torch.save``: ~100 us to write and
~250 us to read here). Sparse tensors and tensors on other devices are pickled the ordinary
way; the engine keeps such messages off the channel anyway.
"""

from __future__ import annotations

import collections
import copyreg
import ctypes
import io
import math
import pickle
import struct
import threading

import torch

_HEADER = struct.Struct("!IQI")  # layout length, pickle length, number of raw buffers
_LENGTH = struct.Struct("!Q")
_EMPTY_ANSWER = 0xFFFFFFFF  # a header's layout length that marks an empty answer


def carries(tensors) -> bool:
    """Whether every tensor can travel on the channel: dense and on the CPU."""
    return all(t.is_cpu and t.layout is torch.strided for t in tensors)


def _tensor_slot(index: int) -> torch.Tensor:
    """Stands in a frame's pickle for the frame's ``index``-th tensor; :class:`_Unpickler`
    resolves it to the tensor (it is never called)."""
    raise RuntimeError("a channel frame must be read with channel.decode")


def _reduce_tensor(t: torch.Tensor):
    tensors = _encoding.tensors
    if not carries((t,)):
        return t.__reduce_ex__(5)
    # The raw bytes below ignore the lazy conjugate / negative bits: materialize them first.
    tensors.append(t.resolve_conj().resolve_neg())
    return _tensor_slot, (len(tensors) - 1,)


_encoding = threading.local()


class _Pickler(pickle.Pickler):
    """Pickle that leaves dense CPU tensors out, as slots into the frame's tensor list (only
    tensors reach Python: ``dispatch_table``, not ``persistent_id``, which sees every object)."""

    dispatch_table = collections.ChainMap({torch.Tensor: _reduce_tensor}, copyreg.dispatch_table)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, tensors: list) -> None:
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module, name):
        if module == __name__ and name == "_tensor_slot":
            return self._tensors.__getitem__
        return super().find_class(module, name)


def encode(obj) -> tuple[list, list]:
    """``obj`` as a frame: (the pieces to write, in order; the tensors they borrow from)."""
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
            parts = [tensors[i].reshape(-1) for i in members]
            flat = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)
            offset = 0
            for i, part in zip(members, parts, strict=True):
                layout.append((i, len(flats), offset, tuple(tensors[i].shape)))
                offset += part.numel()
            flats.append(flat)
    meta = pickle.dumps(([f.dtype for f in flats], layout), protocol=5)
    if len(meta) >= _EMPTY_ANSWER:
        raise ValueError(f"a message with {len(layout)} tensors is too large for one frame")
    body = out.getbuffer()
    views = [_bytes_of(f) for f in flats]
    head = _HEADER.pack(len(meta), len(body), len(views)) + b"".join(
        _LENGTH.pack(v.nbytes) for v in views
    )
    return [memoryview(head), memoryview(meta), body, *views], flats


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
    tensors: list = [None] * len(layout)
    by_group: list[list] = [[] for _ in dtypes]
    for entry in layout:
        by_group[entry[1]].append(entry)
    for dtype, n, entries in zip(dtypes, sizes, by_group, strict=True):
        data = _read_exact(rfile, n)
        numels = [math.prod(shape) for _, _, _, shape in entries]
        flat = torch.frombuffer(data, dtype=dtype) if n else torch.empty(0, dtype=dtype)
        for (i, _, _, shape), part in zip(entries, flat.split(numels), strict=True):
            tensors[i] = part if len(shape) == 1 else part.view(shape)
    return _Unpickler(io.BytesIO(body), tensors).load()


