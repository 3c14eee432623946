"""The channel's wire format (frames.py): what a frame carries, and how."""

from __future__ import annotations

import io

import pytest
import torch

from refimpl.distributed_autograd.frames import (
    FrameError,
    carries,
    decode,
    encode,
    encode_empty_answer,
)


def _round_trip(obj):
    pieces, _keep = encode(obj)
    return decode(io.BytesIO(b"".join(bytes(p) for p in pieces)))


def test_a_frame_carries_every_dense_dtype_and_shape_and_the_rest_by_pickle():
    tensors = [
        torch.randn(64),
        torch.randn(3, 2).t(),  # not contiguous
        torch.zeros(0, 3, dtype=torch.bfloat16),
        torch.ones(2, dtype=torch.bfloat16),
        torch.tensor(True),
        torch.arange(6, dtype=torch.int64).view(2, 3),
        torch.randn(4, dtype=torch.float64),
    ]
    sparse = torch.randn(3).to_sparse()
    obj = (7, "x", [(i, t) for i, t in enumerate(tensors)], {"sparse": sparse}, frozenset({1, 2}))
    out = _round_trip(obj)
    assert out[:2] == (7, "x") and out[4] == frozenset({1, 2})
    for (i, sent), (j, got) in zip(obj[2], out[2], strict=True):
        assert i == j and got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    assert torch.equal(out[3]["sparse"].to_dense(), sparse.to_dense())


def test_received_tensors_are_writable_and_independent_of_the_sender():
    sent = torch.randn(8)
    got = _round_trip([sent])[0]
    got.add_(1.0)  # a read-only buffer would warn or fail here
    assert torch.equal(got, sent + 1.0)


def test_a_lone_contiguous_tensor_goes_out_from_its_own_memory():
    """No copy (frames.py [Note: frames borrow]): the frame's bytes are the tensor's until
    written, so a change made before the write shows in the frame."""
    t = torch.zeros(4, 8)[1:]  # contiguous, at an offset in its storage
    pieces, borrowed = encode((1, [t]))
    t.fill_(5.0)
    got = decode(io.BytesIO(b"".join(bytes(p) for p in pieces)))[1][0]
    assert torch.equal(got, torch.full((3, 8), 5.0)) and borrowed[0].data_ptr() == t.data_ptr()
    # not contiguous, or one of several of its dtype: copied into the frame
    u = torch.zeros(3, 2).t()
    pieces, _ = encode([u, torch.zeros(2), torch.zeros(1, dtype=torch.int64)])
    u.fill_(5.0)
    assert torch.equal(decode(io.BytesIO(b"".join(bytes(p) for p in pieces)))[0], torch.zeros(2, 3))


def test_many_tensors_of_one_dtype_travel_in_one_buffer():
    pieces, _ = encode([torch.randn(64) for _ in range(100)] + [torch.randn(2).double()])
    # header, layout, pickle, then one raw buffer per dtype
    assert len(pieces) == 3 + 2


def test_carries_only_dense_cpu_tensors():
    assert carries([torch.randn(2), torch.zeros(0)])
    assert not carries([torch.randn(2), torch.randn(2).to_sparse()])
    assert not carries([torch.randn(2, device="meta")])
    quantized = torch.quantize_per_tensor(torch.tensor([0.5, 1.5]), 0.5, 3, torch.qint8)
    assert not carries([quantized])
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    assert not carries([nested])


def test_quantized_and_nested_tensors_travel_by_pickle_with_their_parameters():
    quantized = torch.quantize_per_tensor(torch.tensor([0.5, 1.5]), 0.5, 3, torch.qint8)
    nested = torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)])
    got_q, got_n, plain = _round_trip([quantized, nested, torch.ones(2)])
    assert got_q.q_scale() == 0.5 and got_q.q_zero_point() == 3
    assert torch.equal(got_q.dequantize(), quantized.dequantize())
    assert [t.tolist() for t in got_n.unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert plain.tolist() == [1.0, 1.0]




def test_lazy_conjugate_and_negative_views_arrive_as_their_values():
    z = torch.randn(3, dtype=torch.complex64)
    conj, neg = z.conj(), z.conj().imag  # conj bit; neg bit on a real view
    assert conj.is_conj() and neg.is_neg()
    got_conj, got_neg = _round_trip([conj, neg])
    assert torch.equal(got_conj, conj.resolve_conj())
    assert torch.equal(got_neg, neg.resolve_neg())


def test_an_empty_answer_is_a_header_alone_and_reads_back():
    pieces, _ = encode_empty_answer(12345)
    assert len(pieces) == 1 and pieces[0].nbytes == 24  # magic, sizes, check sum
    stream = io.BytesIO(b"".join(bytes(p) for p in (*pieces, *encode((7, "x", None))[0])))
    assert decode(stream) == (12345, None, None)
    assert decode(stream) == (7, "x", None)  # the next frame is read from the right place


def test_a_tail_of_tensors_travels_raw_and_reads_back_beside_the_object():
    """frames.py [Note: a frame's tail]: the list is the frame's tensors, read back into
    ``tensors_out`` in order, however long (and when empty)."""
    tail = [torch.randn(64) for _ in range(100)] + [torch.arange(3), torch.randn(2, 3).t()]
    pieces, _ = encode((4, "f", (1, [2, 3])), tail)
    back: list = []
    assert decode(io.BytesIO(b"".join(bytes(p) for p in pieces)), back) == (4, "f", (1, [2, 3]))
    assert len(back) == len(tail)
    for sent, got in zip(tail, back, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    pieces, _ = encode((5,), [])
    back = []
    assert decode(io.BytesIO(b"".join(bytes(p) for p in pieces)), back) == (5,) and back == []


def test_layouts_are_cached_but_each_frame_reads_its_own_values_and_shape():
    """A lone tensor's layout is written once per (dtype, shape) and read once per layout
    (frames._ONE_META / _LAYOUTS): frames of one layout still carry their own values, and a
    frame of another shape or dtype is not mistaken for a cached one."""
    for t in (torch.arange(6.0).view(2, 3), torch.ones(2, 3), torch.ones(3, 2), torch.ones(6).double()):
        tail: list = []
        pieces, _ = encode((9, "f", (1,), None, True), [t])
        got = decode(io.BytesIO(b"".join(bytes(p) for p in pieces)), tail)
        assert got == (9, "f", (1,), None, True)
        assert len(tail) == 1 and tail[0].dtype == t.dtype and torch.equal(tail[0], t)


# [Note: a header is checked before it is trusted] ------------------------------------------------
def _frame_bytes(obj, tail=None) -> bytes:
    pieces, _ = encode(obj, tail)
    return b"".join(bytes(p) for p in pieces)


class _CountingReader(io.BytesIO):
    """A stream that records the largest read asked of it."""

    largest = 0

    def read(self, n=-1):
        self.largest = max(self.largest, n)
        return super().read(n)


@pytest.mark.parametrize("garbage", [
    bytes(range(24)),  # another protocol's bytes
    b"\x9c\x1f\xe2\x00" * 6,
])
def test_bytes_that_are_not_a_frame_header_raise_before_anything_is_allocated(garbage):
    stream = _CountingReader(garbage + b"\0" * 64)
    with pytest.raises(FrameError, match="not a frame header"):
        decode(stream)
    assert stream.largest == 24


def test_a_header_read_from_the_wrong_place_raises():
    """A frame read a few bytes late (a partial read taken as whole, another thread's read):
    what is there is not a header."""
    data = _frame_bytes((1, "x"), [torch.randn(8)]) * 2
    for shift in (1, 4, 8, 23):
        with pytest.raises(FrameError):
            decode(io.BytesIO(data[shift:]))


def test_buffer_sizes_that_do_not_fit_the_layout_raise_before_they_are_read():
    """The raw buffer sizes follow the header: they must be the ones the layout's shapes and
    dtypes give (a huge one would be allocated otherwise)."""
    from refimpl.distributed_autograd import frames

    data = bytearray(_frame_bytes((1,), [torch.randn(8)]))  # one buffer: 64 bytes
    size_at = frames._HEADER.size
    data[size_at:size_at + 8] = (1 << 62).to_bytes(8, "big")
    stream = _CountingReader(bytes(data))
    with pytest.raises(FrameError, match=r"raw buffers of \[4611686018427387904\] bytes where its layout gives \[32\]"):
        decode(stream)
    assert stream.largest < 1 << 20
    many = bytearray(_frame_bytes((1,), [torch.randn(2), torch.zeros(2, dtype=torch.int64)]))
    many[size_at + 8:size_at + 16] = (7).to_bytes(8, "big")
    with pytest.raises(FrameError, match="where its layout gives"):
        decode(io.BytesIO(bytes(many)))
