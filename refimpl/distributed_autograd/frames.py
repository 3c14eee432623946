"""The channel's wire format: one frame per message (channel.py).

A frame is a fixed header, the layout of its tensors, a pickle of the message with every dense
CPU tensor left out (a slot number in its place), and one raw buffer per dtype holding those
tensors' bytes back to back. 100 small gradients cost one copy and one buffer, not 100 pickled
tensors (a tensor pickled the ordinary way goes through ``torch.save``: ~100 us to write and
~250 us to read here). Sparse tensors and tensors on other devices are pickled the ordinary
way; the engine keeps such messages off the channel anyway.

[Note: frames borrow]
A dtype group of one contiguous tensor (the usual gradient message: one gradient per send
edge) goes out as that tensor's own bytes, without a copy: the frame borrows them. The channel
writes a frame before ``Connection.write`` returns, or copies what the socket did not take
(channel.py), so a tensor changed in place after its message was sent (a parameter fetched by
``to_here`` and then stepped) never changes bytes still to be written.

[Note: a frame's tail]
A gradient message carries one list of tensors (one per send edge) next to a few ints. Left
in the pickle, every tensor costs a Python call each way (the slot's reducer, then the slot's
lookup) and a pickled tuple around it: 100 gradients, ~200 calls per message. ``encode(obj,
tail=tensors)`` sends the list as the frame's tensors and pickles ``obj`` with the plain C
pickler; ``decode(rfile, tensors_out)`` puts them back in ``tensors_out`` (no call per tensor
either way), and the channel hands them to the handler as its last argument. ``obj`` must then
hold no tensor of its own.

[Note: a header is checked before it is trusted]
A frame's header says how many bytes follow; a reader that believed a wrong one would allocate
it. Bytes that are not a frame header reach ``decode`` only through a fault (a stream read from
the wrong place, a frame cut short), and the same bytes written into another protocol's stream
are how a ``std::bad_alloc`` kills a process: TensorPipe and gloo read a length first and
allocate it (the channel's other side of this is connection.py [Note: a descriptor outlives its
users] and handshake.py). So every header starts with a magic word and ends with a CRC-32 of
itself, the layout's size and the number of raw buffers are bounded, and every buffer size must
be the one its layout's shapes and dtypes give, all before a byte is allocated; any of these
failing raises :class:`FrameError`, which says what was read.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import math
import pickle
import struct
import threading
import zlib

import torch

from .._torch_compat import flatten_dense

# magic, layout length, pickle length, number of raw buffers; then a CRC-32 of those 20 bytes
_MAGIC = b"RDA1"
_FIELDS = struct.Struct("!4sIQI")
_CHECK = struct.Struct("!I")
_HEADER = struct.Struct("!4sIQII")
_EMPTY_ANSWER = 0xFFFFFFFF  # a header's layout length that marks an empty answer
_MAX_BUFFERS = 64  # raw buffers per frame at most: one per dtype (torch has fewer dtypes)
_MAX_LAYOUT = 1 << 26  # bytes of a frame's layout at most (64 MiB: ~millions of tensors)


class FrameError(ConnectionError):
    """What was read is not a frame of this channel (see [Note: a header is checked before it
    is trusted]); the connection it came from cannot be read any further."""


def _header(meta_len: int, body_len: int, count: int) -> bytes:
    fields = _FIELDS.pack(_MAGIC, meta_len, body_len, count)
    return fields + _CHECK.pack(zlib.crc32(fields))


def carries(tensors) -> bool:
    """Whether every tensor can travel on the channel as raw bytes: dense, on the CPU, neither
    quantized (its scale and zero point are not bytes of the tensor) nor nested."""
    return all(map(_plain, tensors))  # no generator frame: messages carry 100s of gradients


def _plain(t: torch.Tensor) -> bool:
    return t.is_cpu and t.layout is torch.strided and not t.is_quantized and not t.is_nested


def _tensor_slot(index: int) -> torch.Tensor:
    """Stands in a frame's pickle for the frame's ``index``-th tensor: while :func:`decode`
    unpickles a frame on this thread, the call returns that tensor. Resolving slots by a call,
    not by a ``find_class`` override, keeps the unpickling in C (``pickle.loads``)."""
    tensors = getattr(_decoding, "tensors", None)
    if tensors is None:
        raise RuntimeError("a channel frame must be read with frames.decode")
    return tensors[index]



def _reduce_tensor(t: torch.Tensor):
    if not _plain(t):
        return t.__reduce_ex__(5)
    tensors = _encoding.tensors
    tensors.append(t)
    return _tensor_slot, (len(tensors) - 1,)


_encoding = threading.local()
_decoding = threading.local()


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


def encode(obj, tail: list | None = None) -> tuple[list, list]:
    """``obj`` as a frame: (the pieces to write, in order; the tensors they borrow from).

    ``tail``: a list of dense CPU tensors sent beside ``obj`` (see [Note: a frame's tail]);
    ``obj`` holds no tensor then. The layout names, per dtype, the slots
    its buffer holds and their shapes, in order.
    """
    if tail is not None:
        tensors = tail
        body = memoryview(pickle.dumps(obj, protocol=5))
    else:
        tensors = []
        out = io.BytesIO()
        _encoding.tensors = tensors
        try:
            _Pickler(out, protocol=5).dump(obj)
        finally:
            _encoding.tensors = None
        body = out.getbuffer()
    if not tensors and tail is None:
        return [memoryview(_header(len(_NO_LAYOUT), len(body), 0)), _NO_LAYOUT_VIEW, body], []
    if len(tensors) == 1:  # the usual gradient message: no grouping, no copy, layout cached
        flat = _values(tensors[0])
        key = (flat.dtype, flat.shape)
        meta = _ONE_META.get(key)
        if meta is None:
            meta = _remember(
                _ONE_META, key, pickle.dumps(
                    ([_dtype_name(flat.dtype)], [([0], [tuple(flat.shape)])]), protocol=5
                )
            )
        view = _bytes_of(flat)
        head = _header(len(meta), len(body), 1) + _ONE_SIZE.pack(view.nbytes)
        return [memoryview(head), memoryview(meta), body, view], [flat]
    else:
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        flats, layout = [], []
        with torch.no_grad():
            for members in groups.values():
                parts = [tensors[i] for i in members]
                shapes = [tuple(part.shape) for part in parts]
                flats.append(_values(parts[0]) if len(parts) == 1 else _flatten(parts, shapes))
                layout.append((members, shapes))
    meta = pickle.dumps(([_dtype_name(f.dtype) for f in flats], layout), protocol=5)
    if len(meta) > _MAX_LAYOUT:
        raise ValueError(f"a message with {len(tensors)} tensors is too large for one frame")
    views = [_bytes_of(f) for f in flats]
    head = _header(len(meta), len(body), len(views)) + struct.pack(
        f"!{len(views)}Q", *(v.nbytes for v in views)
    )
    return [memoryview(head), memoryview(meta), body, *views], flats


def _values(t: torch.Tensor) -> torch.Tensor:
    """A lone tensor's values, contiguous: the tensor itself when it already is (see [Note:
    frames borrow]). Raw bytes ignore the lazy conjugate / negative bits: resolved here."""
    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


# Layouts by (dtype, shape) of a lone tensor (encode) and by their bytes (decode): a message's
# layout repeats from pass to pass, and reading or writing it anew costs a pickle each way.
_ONE_META: dict = {}
_LAYOUTS: dict = {}
_CACHED = 1024  # entries per cache at most (a cache that fills up starts again)


def _remember(cache: dict, key, value):
    if len(cache) >= _CACHED:
        cache.clear()
    cache[key] = value
    return value


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_DTYPES: dict[str, torch.dtype] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """A dtype's name in a frame's layout (a pickled ``torch.dtype`` costs a global lookup each
    way; a name is a plain string)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a frame names an unknown dtype {name!r}")
        _DTYPES[name] = dtype
    return dtype


_NO_LAYOUT = pickle.dumps(([], []), protocol=5)
_NO_LAYOUT_VIEW = memoryview(_NO_LAYOUT)


def _flatten(parts: list, shapes: list) -> torch.Tensor:
    """The parts' values back to back, in one kernel where their shapes allow: gradients are
    often one shape, and often views (a sum's gradient is an expanded scalar), which
    ``flatten_dense`` would first copy one by one (100 expanded gradients: 184 us; ``cat``:
    21 us). Raw bytes ignore the lazy conjugate / negative bits: the values are resolved."""
    if all(len(shape) == 1 for shape in shapes):
        flat = torch.cat(parts)
    elif len(set(shapes)) == 1:
        flat = torch.stack(parts).reshape(-1)
    else:
        flat = flatten_dense(parts)
    return flat.resolve_conj().resolve_neg()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the tensor must outlive them)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def _read_exact(rfile, n: int) -> bytearray:
    """``n`` bytes into a buffer of their own (writable: tensors are made on it)."""
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
    return [memoryview(_header(_EMPTY_ANSWER, seq, 0))], []


_HEADER_SIZE = _HEADER.size


def decode(rfile, tensors_out: list | None = None):
    """Read one frame (see :func:`encode`) from a buffered reader: the object. ``tensors_out``:
    a list that gets the frame's tensors (a tail sent beside the object, not in it).

    The usual gradient message (one tensor, a layout seen before) is read with a handful of C
    calls and no Python call: this runs on a thread that just woke up, where every call costs
    microseconds."""
    header = rfile.read(_HEADER_SIZE)
    if len(header) != _HEADER_SIZE:
        raise ConnectionError("connection closed by peer (EOF)")
    magic, meta_len, body_len, count, check = _HEADER.unpack(header)
    if magic != _MAGIC or zlib.crc32(header[:-4]) != check:
        raise FrameError(f"not a frame header (magic or check sum wrong): {header.hex()}")
    if meta_len == _EMPTY_ANSWER:
        return body_len, None, None
    if count > _MAX_BUFFERS or meta_len > _MAX_LAYOUT:
        raise FrameError(
            f"a frame header announces {count} raw buffers and a {meta_len}-byte layout (at most "
            f"{_MAX_BUFFERS} and {_MAX_LAYOUT}): {header.hex()}"
        )
    size = 8 * count + meta_len + body_len
    head = rfile.read(size)  # buffer sizes, layout, pickle: one read
    if len(head) != size:
        raise ConnectionError("connection closed by peer (EOF)")
    meta_end = 8 * count + meta_len
    if not count:
        return pickle.loads(memoryview(head)[meta_end:])
    meta = head[8 * count : meta_end]
    parsed = _LAYOUTS.get(meta)
    if parsed is None:
        parsed = _remember(_LAYOUTS, meta, _parse_layout(meta))
    dtypes, layout, total, sizes = parsed
    if count == 1 and total == 1:  # one tensor: its bytes, viewed in its shape
        (n,) = _ONE_SIZE.unpack_from(head)
        if (n,) != sizes:
            _wrong_sizes((n,), sizes)
        if n:  # a buffered reader's readinto fills the buffer unless the stream ends
            data = bytearray(n)
            if rfile.readinto(data) != n:
                raise ConnectionError("connection closed by peer (EOF)")
            flat = torch.frombuffer(data, dtype=dtypes[0])
        else:
            flat = torch.empty(0, dtype=dtypes[0])
        tensors = [flat.view(layout[0][1][0])]
    else:
        got = struct.unpack_from(f"!{count}Q", head)
        if got != sizes:
            _wrong_sizes(got, sizes)
        tensors = _tensors(rfile, got, dtypes, layout, total)
    if tensors_out is not None:
        tensors_out.extend(tensors)
    _decoding.tensors = tensors
    try:
        return pickle.loads(memoryview(head)[meta_end:])
    finally:
        _decoding.tensors = None


_ONE_SIZE = struct.Struct("!Q")


def _parse_layout(meta: bytes) -> tuple:
    """A frame's layout as (dtypes, [(members, shapes)] per dtype, number of tensors, the byte
    size of each raw buffer that the shapes and dtypes give)."""
    names, layout = pickle.loads(meta)
    dtypes = [_dtype(n) for n in names]
    if len(dtypes) != len(layout):
        raise FrameError(f"a frame's layout names {len(dtypes)} dtypes for {len(layout)} buffers")
    sizes = tuple(
        sum(math.prod(shape) for shape in shapes) * dtype.itemsize
        for dtype, (_, shapes) in zip(dtypes, layout, strict=True)
    )
    return dtypes, layout, sum(len(m) for m, _ in layout), sizes


def _wrong_sizes(got: tuple, expected: tuple) -> None:
    raise FrameError(
        f"a frame announces raw buffers of {list(got)} bytes where its layout gives "
        f"{list(expected)}"
    )


def _tensors(rfile, sizes, dtypes, layout, total) -> list:
    """A frame's tensors, read from its raw buffers (one per dtype) in layout order."""
    tensors: list = [None] * total
    for dtype, n, (members, shapes) in zip(dtypes, sizes, layout, strict=True):
        if n:
            flat = torch.frombuffer(_read_exact(rfile, n), dtype=dtype)
        else:
            flat = torch.empty(0, dtype=dtype)
        if len(members) == 1:
            tensors[members[0]] = flat.view(shapes[0])
        elif len(set(shapes)) == 1:  # one shape: one view, cut along its first dimension
            for i, part in zip(members, flat.view(len(shapes), *shapes[0]).unbind(0), strict=True):
                tensors[i] = part
        else:
            parts = flat.split([math.prod(shape) for shape in shapes])
            for i, shape, part in zip(members, shapes, parts, strict=True):
                tensors[i] = part if len(shape) == 1 else part.view(shape)
    return tensors
