"""Server-side aggregation helpers shared by the methods.

* :func:`weighted_average` -- sample-weighted averaging of state dicts (FedAvg, McMahan et al.
  2017, Alg. 1; RaFL Eq. 7 for the knowledge networks);
* :func:`payload_weights` -- the weights ``n_l / N_S`` from uploads' ``n_samples``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from rafl.errors import UserInputError
from rafl.federation.payload import Payload


def payload_weights(uploads: Sequence[Payload]) -> list[float]:
    """``n_l / N_S`` for every upload, ``N_S = sum_l n_l`` over the uploads (RaFL Eq. 7).

    Raises:
        UserInputError: an upload without a positive ``meta["n_samples"]``.
    """
    counts = []
    for p in uploads:
        n = p.meta.get("n_samples")
        if not isinstance(n, (int, float)) or n <= 0:
            raise UserInputError(f"needs a positive n_samples, got {n!r}",
                                 source=f"payload from client {p.meta.get('client_id', '?')}")
        counts.append(float(n))
    total = sum(counts)
    return [c / total for c in counts]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """``sum_l w_l * theta_l`` key by key (RaFL Eq. 7: ``theta_k = sum_l (n_l / N_S) theta_k^l``).

    Floating tensors are averaged in float64 and cast back to their dtype; integer tensors (e.g.
    BatchNorm's ``num_batches_tracked``) take the weighted average rounded to the nearest integer.

    Args:
        states: >= 1 mappings with identical keys and shapes.
        weights: one weight per state; normalized to sum to 1 here.

    Returns:
        a new state dict (CPU tensors).

    Raises:
        ValueError: no states, mismatched lengths, keys or shapes, or non-positive total weight.
    """
    if not states or len(states) != len(weights):
        raise ValueError(f"need >= 1 state and one weight per state, got {len(states)} and {len(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to > 0")
    w = [float(x) / total for x in weights]
    keys = list(states[0].keys())
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        ref = states[0][key]
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for s, wi in zip(states, w):
            if key not in s:
                raise ValueError(f"state is missing {key!r}")
            t = s[key]
            if t.shape != ref.shape:
                raise ValueError(f"{key!r}: shape {tuple(t.shape)} != {tuple(ref.shape)}")
            acc += wi * t.detach().to("cpu", torch.float64)
        out[key] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
    return out


__all__ = ["weighted_average", "payload_weights"]
