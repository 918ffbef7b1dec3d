"""Torch's CPU thread count for a block of work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` (``None``: unchanged), then restore.

    The search's tensors are small (an MLP on ~100 encodings, subnets at 24-32 px): one thread is
    fastest, and on a shared machine extra OpenMP threads make them many times slower.
    """
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


__all__ = ["torch_threads"]
