"""What the independent-zoo tests compare: a rank's probe results, equal to the last bit."""

from __future__ import annotations

import torch


def same(a, b) -> bool:
    """Nested dicts of tensors (or plain values) equal in keys, dtypes and every bit."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
