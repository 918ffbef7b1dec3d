"""MACs and parameters as fvcore and thop count them: the counters the cost model is checked
against and the profiling report prints."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import torch
from torch import nn


def count_fvcore(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """fvcore's counts (fvcore "flops" = MACs for conv/linear) per module and per operator.

    Returns:
        ``(per_module, per_operator)``: ``per_module[name][op]`` (submodules included in their
        parents) and the whole model's ``{op: count}``.
    """
    with warnings.catch_warnings():  # torch.jit deprecation notices from fvcore's import and tracer
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from fvcore.nn import FlopCountAnalysis  # noqa: PLC0415 - under the filter: its import warns; heavy

        fca = FlopCountAnalysis(model, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False)
        per_module = {k: dict(v) for k, v in fca.by_module_and_operator().items()}
        return per_module, dict(fca.by_operator())


def count_thop(model: nn.Module, x: torch.Tensor) -> tuple[float, dict[str, Any]]:
    """thop's total ops and its per-child tree ``{name: (ops, params, children)}``.

    thop is run on a deep copy (it leaves ``total_ops`` buffers on the modules it profiles)."""
    from thop import profile  # noqa: PLC0415 - thop: loaded only when a report cross-checks a count

    logging.getLogger().setLevel(logging.WARNING)
    clone = copy.deepcopy(model).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        total, _, tree = profile(clone, inputs=(x,), verbose=False, ret_layer_info=True)
    return float(total), tree


MAC_OPS = ("conv", "linear", "matmul", "addmm", "bmm", "einsum")  # fvcore's names of multiply-add ops


def model_macs_params(model: nn.Module, resolution: int, channels: int = 3) -> tuple[float, float]:
    """``(MACs in millions, parameters in millions)`` of ``model`` for one image of
    ``resolution`` px: fvcore's ``conv`` + ``linear`` counts on a deep copy (one multiply-add
    counts one), the quantity the cost model and the device budgets use (``macs_m``,
    :mod:`rafl.search.cost`); BatchNorm, activations, pooling and the SE gating multiply, which
    fvcore also counts, are left out as there."""
    m = copy.deepcopy(model).eval()
    x = torch.zeros(1, channels, resolution, resolution)
    with torch.no_grad():
        _, per_op = count_fvcore(m, x)
    macs = sum(v for op, v in per_op.items() if op in MAC_OPS)
    params = sum(p.numel() for p in model.parameters())
    return macs / 1e6, params / 1e6


__all__ = ["MAC_OPS", "count_fvcore", "count_thop", "model_macs_params"]
