"""Where a client's model sits inside one global model, and averaging over the clients holding each weight.

The weight-sharing methods (HeteroFL, FedRolex; :mod:`rafl.federation.algorithms.heterofl`) keep
one global model and give every client a *slice* of it. A slice is an :data:`IndexMap`: for every
tensor ``k`` of the client's ``state_dict``, the global tensor it lives in and the flat positions
(a ``LongTensor`` of ``numel`` entries, in the client tensor's row-major order) of its elements
there, so ``client[k] == global[g].flatten()[flat].view(shape)``.

Two kinds of global model:

* **NAS subnets** (:func:`nas_index_map`): the global model is the OFA supernet. A subnet holds the
  first ``d`` blocks of each stage (elastic depth), the first ``round(e * C_in)`` expanded channels
  of each block (elastic expand: ofa sorts these channels by importance, so the prefix holds the most
  important ones), the centre ``k x k`` of the largest depthwise kernel (elastic kernel), and the
  stem, the first block and the head whole. The map is read off ofa's own ``get_active_subnet`` run
  on a probe supernet whose every element holds its own global position (float64) with the kernel
  transformation matrices switched off, so it is ofa's extraction by construction.
* **Width-sliced models** (:func:`prefix_index_map`): the global model is the widest member; a
  narrower one holds the prefix of every dimension (HeteroFL, Diao et al., ICLR 2021, Sec. 3.1).

FedRolex (Alam et al., NeurIPS 2022, Sec. 3) replaces the prefix along the sliced channel
dimension with a window that rolls by one channel per round: channel ``j`` of the client is global
channel ``(s + j) mod C`` with ``s = (round - 1) mod C`` (``roll``).

:func:`masked_average` averages every element over the uploads holding it.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from ofa.imagenet_classification.elastic_nn.modules.dynamic_layers import adjust_bn_according_to_idx
from ofa.imagenet_classification.elastic_nn.modules.dynamic_op import DynamicSeparableConv2d, sub_filter_start_end
from torch import nn

from rafl.errors import UserInputError
from rafl.federation.aggregation import AggregationRule, clip_scales, coordinatewise, update_norms
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.model import build_supernet, extract_subnet

#: client state-dict key -> (global key, flat positions (numel,) int64 in the global tensor)
IndexMap = dict[str, tuple[str, torch.Tensor]]


def extract(global_state: Mapping[str, torch.Tensor], index: IndexMap,
            keys: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The client's tensors cut out of ``global_state`` (new tensors; ``keys``: a subset of the map)."""
    out = {}
    for key in (index if keys is None else keys):
        gkey, (flat, shape) = index[key][0], _flat_shape(index[key])
        out[key] = global_state[gkey].reshape(-1)[flat].reshape(shape).clone()
    return out


def _flat_shape(entry: tuple[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[int, ...]]:
    flat = entry[1]
    return flat.reshape(-1), tuple(flat.shape)


def masked_average(global_state: Mapping[str, torch.Tensor],
                   uploads: Sequence[tuple[Mapping[str, torch.Tensor], IndexMap, float]],
                   rule: AggregationRule | None = None) -> dict[str, torch.Tensor]:
    """Average every global element over the uploads that hold it; elements no upload holds keep
    their value (HeteroFL, Diao et al. 2021, Eq. 3: ``W[e] = sum_{l holds e} w_l W_l[e] /
    sum_{l holds e} w_l``), merged by the run's rule (``engine.aggregation``).

    * ``mean`` (or ``rule`` None): Eq. 3 as written.
    * ``norm_clip``: every upload's update ``Delta_l = W_l - W[slice_l]`` (its floating tensors,
      one global L2 norm) is scaled by ``s_l = min(1, M / ||Delta_l||_2)`` for ``M = rule.clip_norm``
      (Sun et al. 2019, Sec. 4) before Eq. 3. With no ``clip_norm`` the bound is relative:
      ``s_l = min(1, T / t_l)`` with ``t_l = w_l ||Delta_l||_2 / sqrt(n_l)`` (the weighted RMS of
      the update over the ``n_l`` elements the client holds, so a narrow slice is not clipped for
      being narrow) and ``T`` the lower median of the round's ``t_l``; where every upload holds every
      element this is :func:`rafl.federation.aggregation.robust_average`'s ``norm_clip``.
    * ``median`` / ``trimmed_mean``: per element, the coordinate-wise median or ``beta``-trimmed
      mean over the uploads holding it (Yin et al. 2018, Defs. 1 and 2); weights are not used.

    Args:
        global_state: the global model (not modified).
        uploads: ``(client tensors, their IndexMap, weight)`` per upload, in a fixed order; a
            client tensor absent from the upload (e.g. static-BN statistics) is simply not held.
            Weights are the clients' sample counts (sample weighting) or 1 (count weighting).
        rule: the run's :class:`~rafl.federation.aggregation.AggregationRule`, or None (``mean``).

    Returns:
        a new global state. Under ``mean`` the arithmetic is
        :func:`rafl.federation.aggregation.weighted_average`'s (float64, weights ``(c_l / S) /
        sum(c / S)`` over the holders, summed in upload order from zero; integer tensors rounded),
        so where every upload holds every element the result equals FedAvg's bit for bit.
    """
    name = "mean" if rule is None else rule.name
    if name == "norm_clip":
        uploads = _clipped_uploads(global_state, uploads, rule)
    out: dict[str, torch.Tensor] = {}
    by_key: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for i, (tensors, index, _w) in enumerate(uploads):
        for key, value in tensors.items():
            gkey, flat = index[key][0], index[key][1].reshape(-1)
            by_key.setdefault(gkey, []).append((i, flat, value.reshape(-1)))
    weights = [float(w) for _t, _m, w in uploads]
    for gkey, ref in global_state.items():
        held = by_key.get(gkey)
        if not held:
            out[gkey] = ref.clone()
            continue
        numel = ref.numel()
        mask = torch.zeros((len(held), numel), dtype=torch.bool)
        for row, (_i, flat, _v) in enumerate(held):
            mask[row, flat] = True
        patterns, inverse = torch.unique(mask.T, dim=0, return_inverse=True)
        result = ref.reshape(-1).to(torch.float64).clone()
        dense = []
        for _i, flat, value in held:
            full = torch.zeros(numel, dtype=torch.float64)
            full[flat] = value.to(torch.float64)
            dense.append(full)
        for p, pattern in enumerate(patterns):
            rows = [r for r in range(len(held)) if bool(pattern[r])]
            if not rows:
                continue  # held by no upload: unchanged
            where = (inverse == p).nonzero().reshape(-1)
            if name in ("median", "trimmed_mean") and ref.is_floating_point():
                result[where] = coordinatewise(torch.stack([dense[r][where] for r in rows]), rule)
                continue
            counts = [weights[held[r][0]] for r in rows]
            total = sum(counts)
            norm = [c / total for c in counts]  # payload_weights
            s = float(sum(norm))
            acc = torch.zeros(where.numel(), dtype=torch.float64)
            for r, wr in zip(rows, norm):
                acc += (float(wr) / s) * dense[r][where]  # weighted_average
            result[where] = acc
        out[gkey] = (result.to(ref.dtype) if ref.is_floating_point() else result.round().to(ref.dtype)).reshape(ref.shape)
    return out


def _clipped_uploads(global_state: Mapping[str, torch.Tensor],
                     uploads: Sequence[tuple[Mapping[str, torch.Tensor], IndexMap, float]],
                     rule: AggregationRule) -> list[tuple[dict[str, torch.Tensor], IndexMap, float]]:
    """``norm_clip`` of :func:`masked_average`: every upload's floating tensors moved to
    ``ref + s_l (W_l - ref)``, ``ref`` the global slice it was cut from."""
    refs, norms, sizes = [], [], []
    for tensors, index, _w in uploads:
        ref = {k: v.to(torch.float64) for k, v in
               extract(global_state, index, [k for k, v in tensors.items() if v.is_floating_point()]).items()}
        refs.append(ref)
        norms.append(update_norms([tensors], ref)[0])
        sizes.append(max(1, sum(r.numel() for r in ref.values())))
    if rule.clip_norm is not None:
        scales = clip_scales(norms, rule.clip_norm)
    else:
        total = float(sum(float(w) for _t, _m, w in uploads)) or 1.0
        scales = clip_scales([float(w) / total * n / math.sqrt(k) for (_t, _m, w), n, k in zip(uploads, norms, sizes)])
    out = []
    for (tensors, index, w), ref, sc in zip(uploads, refs, scales):
        if sc < 1:
            tensors = {k: (ref[k] + sc * (v.to(torch.float64) - ref[k])).to(v.dtype) if k in ref else v
                       for k, v in tensors.items()}
        out.append((dict(tensors), index, w))
    return out


# ---------------------------------------------------------------------- width-sliced models
def rolled(size: int, keep: int, start: int) -> torch.Tensor:
    """FedRolex's window: ``(start + arange(keep)) mod size`` (Alam et al. 2022, Eq. 4)."""
    return (torch.arange(keep, dtype=torch.int64) + int(start)) % int(size)


def prefix_index_map(local: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                     round_: int | None = None, name: str = "model") -> IndexMap:
    """The slice of ``global_state`` a width-sliced ``local`` state holds: the prefix of every
    dimension (HeteroFL), or with ``round_`` FedRolex's window ``(round_ - 1) mod C`` along every
    dimension narrower than the global one.

    Raises:
        UserInputError: ``local`` is not width-sliceable from ``global_state``: other tensor names,
            another number of dimensions, or a dimension wider than the global model's (naming the
            first offending tensor).
    """
    if set(local) != set(global_state):
        extra = sorted(set(local) ^ set(global_state))
        raise UserInputError(f"{name} is not width-sliceable from the widest model: its tensors differ in name "
                             f"(e.g. {extra[0]!r}); allowed: models that differ only in the width of their layers "
                             "(e.g. the group heterofl-cnn4: cnn4@1, cnn4@0.5, cnn4@0.25, cnn4@0.125)",
                             field="clients.models")
    out: IndexMap = {}
    for key, t in local.items():
        g = global_state[key]
        if t.dim() != g.dim() or any(a > b for a, b in zip(t.shape, g.shape)):
            raise UserInputError(f"{name} is not width-sliceable from the widest model: {key!r} has shape "
                                 f"{list(t.shape)}, the widest model {list(g.shape)}; allowed: every dimension at "
                                 "most the widest model's", field="clients.models")
        strides = torch.tensor(g.stride() if g.is_contiguous() else g.contiguous().stride(), dtype=torch.int64)
        flat = torch.zeros(tuple(t.shape), dtype=torch.int64)
        for d, (n_local, n_global) in enumerate(zip(t.shape, g.shape)):
            if round_ is not None and n_local < n_global:
                idx = rolled(n_global, n_local, (int(round_) - 1) % n_global)
            else:
                idx = torch.arange(n_local, dtype=torch.int64)
            view = [1] * t.dim()
            view[d] = n_local
            flat = flat + (idx * strides[d]).view(view)
        out[key] = (key, flat)
    return out


# ---------------------------------------------------------------------- NAS subnets
@contextlib.contextmanager
def _no_kernel_transform():
    """ofa's elastic kernel as a plain centre crop (the transformation matrices switched off)."""
    saved = DynamicSeparableConv2d.KERNEL_TRANSFORM_MODE
    DynamicSeparableConv2d.KERNEL_TRANSFORM_MODE = None
    try:
        yield
    finally:
        DynamicSeparableConv2d.KERNEL_TRANSFORM_MODE = saved


def is_kernel_matrix(key: str) -> bool:
    """Whether a supernet state-dict key is one of ofa's kernel transformation matrices."""
    return key.endswith("_matrix")


def roll_middle_channels(layer: nn.Module, shift: int) -> None:
    """Rotate an ofa ``DynamicMBConvLayer``'s expanded (middle) channels so that channel ``j``
    becomes old channel ``(j + shift) mod M`` in every tensor that has that dimension -- the
    tensors ofa's own ``re_organize_middle_weights`` reorders (inverted bottleneck, depthwise
    conv and their BNs, SE reduce/expand, point-wise projection)."""
    m = layer.depth_conv.conv.conv.weight.shape[0]
    idx = rolled(m, m, shift % m)
    sel = torch.index_select
    layer.point_linear.conv.conv.weight.data = sel(layer.point_linear.conv.conv.weight.data, 1, idx)
    adjust_bn_according_to_idx(layer.depth_conv.bn.bn, idx)
    layer.depth_conv.conv.conv.weight.data = sel(layer.depth_conv.conv.conv.weight.data, 0, idx)
    if layer.use_se:
        fc = layer.depth_conv.se.fc
        fc.expand.weight.data = sel(fc.expand.weight.data, 0, idx)
        fc.expand.bias.data = sel(fc.expand.bias.data, 0, idx)
        fc.reduce.weight.data = sel(fc.reduce.weight.data, 1, idx)
    if layer.inverted_bottleneck is not None:
        adjust_bn_according_to_idx(layer.inverted_bottleneck.bn.bn, idx)
        layer.inverted_bottleneck.conv.conv.weight.data = sel(layer.inverted_bottleneck.conv.conv.weight.data, 0, idx)


def _space_key(space) -> str:
    return json.dumps(space.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=4)
def _probe(space_key: str):
    """``(net, keys, offsets)``: a float64 supernet of the space whose floating tensors ``keys`` (the
    kernel matrices excepted) hold their elements' positions ``offsets[i] + 0..numel-1`` in one
    numbering of all of them."""
    space = SearchSpace.from_dict(json.loads(space_key))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        net = build_supernet(space, zero_last_gamma=False)
    finally:
        torch.set_default_dtype(old)
    keys, offsets = [], [0]
    with torch.no_grad():
        for key, t in net.state_dict().items():
            if t.is_floating_point() and not is_kernel_matrix(key):
                t.copy_(torch.arange(offsets[-1], offsets[-1] + t.numel(), dtype=torch.float64).view(t.shape))
                keys.append(key)
                offsets.append(offsets[-1] + t.numel())
    if offsets[-1] >= 2**53:
        raise RuntimeError("supernet too large for the float64 probe")
    return net, tuple(keys), tuple(offsets)


@functools.lru_cache(maxsize=256)
def _nas_map(space_key: str, arch_string: str, shifts: tuple[int, ...]) -> tuple[tuple[str, str, tuple[int, ...], bytes], ...]:
    space = SearchSpace.from_dict(json.loads(space_key))
    probe, gkeys, offsets = _probe(space_key)
    if any(shifts):
        probe = copy.deepcopy(probe)
        for block, s in zip(probe.blocks[1:], shifts):
            if s:
                roll_middle_channels(block.conv, s)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the extracted layers hold the positions exactly
    try:
        with _no_kernel_transform():
            sub = extract_subnet(probe, ArchConfig.from_string(arch_string, space))
    finally:
        torch.set_default_dtype(old)
    entries = []
    sub_sd = sub.state_dict()
    for key, t in sub_sd.items():
        if not t.is_floating_point():
            continue
        ids = t.detach().reshape(-1).to(torch.int64)
        pos = bisect.bisect_right(offsets, int(ids[0])) - 1
        flat = ids - offsets[pos]
        if bool((flat < 0).any()) or bool((flat >= offsets[pos + 1] - offsets[pos]).any()):
            raise RuntimeError(f"subnet tensor {key!r} spans several supernet tensors")
        entries.append((key, gkeys[pos], tuple(t.shape), flat.numpy().tobytes()))
    # BN counters: the num_batches_tracked of the BN whose running_mean holds the subnet BN's
    by_key = {e[0]: e[1] for e in entries}
    for key, t in sub_sd.items():
        sibling = key.rsplit(".", 1)[0] + ".running_mean"
        if not t.is_floating_point() and key.endswith("num_batches_tracked") and sibling in by_key:
            gkey = by_key[sibling].rsplit(".", 1)[0] + ".num_batches_tracked"
            entries.append((key, gkey, tuple(t.shape), torch.zeros(t.numel(), dtype=torch.int64).numpy().tobytes()))
    return tuple(entries)


def middle_channels(space) -> list[int]:
    """The number of expanded channels ``M`` of every elastic block of ``space``'s supernet."""
    net = _probe(_space_key(space))[0]
    return [int(b.conv.depth_conv.conv.conv.weight.shape[0]) for b in net.blocks[1:]]


def nas_index_map(space, arch, shifts: Sequence[int] | None = None) -> IndexMap:
    """Where subnet ``arch``'s ``state_dict`` (as :func:`rafl.supernet.extract_subnet` builds it)
    sits in the supernet of ``space``: ofa's extraction with the kernel transformation matrices off
    (the centre ``k x k`` of the largest kernel). ``shifts``: per elastic block, FedRolex's rotation
    of the expanded channels (None or zeros: OFA's importance-sorted prefix).

    The kernel transformation matrices belong to no subnet (they are never sent nor averaged);
    :func:`fold_kernel_transforms` writes their effect into the kernels once, before federating, so
    that this map is also ofa's extraction (with the matrices) of the folded supernet.
    """
    key = _space_key(space)
    n_blocks = len(_probe(key)[0].blocks) - 1
    sh = tuple(int(s) for s in (shifts or [0] * n_blocks))
    out: IndexMap = {}
    for k, g, shape, raw in _nas_map(key, arch.to_string(space), sh):
        flat = torch.from_numpy(np.frombuffer(raw, dtype=np.int64).copy())
        out[k] = (g, flat.reshape(shape))
    return out


def smallest_kernels(supernet, archs) -> list[int]:
    """Per elastic block of ``supernet``, the smallest kernel any of ``archs`` uses there (a block
    beyond an arch's depth is not used by it); the largest kernel where no arch uses the block."""
    sizes = [max(b.conv.depth_conv.conv.kernel_size_list) for b in supernet.blocks[1:]]
    out = list(sizes)
    for arch in archs:
        for stage, idx in enumerate(supernet.block_group_info):
            for i in idx[: arch.d[stage]]:
                out[i - 1] = min(out[i - 1], int(arch.ks[i - 1]))
    return out


def fold_kernel_transforms(supernet, smallest: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """The supernet's state with OFA's kernel transformation matrices folded into the kernels, nested.

    OFA (Cai et al. 2020, Sec. 3.2) derives a ``k x k`` depthwise filter from the centre of the next
    larger one through a learned ``k^2 x k^2`` matrix. For every elastic block and every kernel size
    ``k`` from the largest down to ``smallest[block]`` (default: all sizes), the centre ``k x k`` of
    the largest kernel is overwritten with ofa's transformed ``k x k`` filter of the original
    supernet (``get_active_filter``) and the matrix into ``k`` is set to the identity; matrices into
    smaller sizes are kept. Afterwards ofa's extraction of kernel ``smallest[block]`` returns exactly
    the original supernet's filter, a larger kernel keeps its own ring around the smaller kernels'
    filters, extraction of every size down to ``smallest[block]`` is the plain centre crop HeteroFL
    slices by, and smaller sizes are still OFA's transformation of that centre.

    Args:
        supernet: a :class:`rafl.supernet.Supernet` (left unchanged).
        smallest: per elastic block, the smallest kernel to fold down to (:func:`smallest_kernels`).

    Returns:
        a new state dict (CPU tensors).
    """
    state = {k: v.detach().cpu().clone() for k, v in supernet.state_dict().items()}
    with torch.no_grad():
        for bi, block in enumerate(supernet.blocks[1:], start=1):
            dconv = block.conv.depth_conv.conv
            sizes = sorted(set(dconv.kernel_size_list), reverse=True)
            floor = sizes[-1] if smallest is None else int(smallest[bi - 1])
            m = dconv.conv.weight.shape[0]
            key = f"blocks.{bi}.conv.depth_conv.conv.conv.weight"
            for src, k in zip(sizes, sizes[1:]):
                if k < floor:
                    break
                start, end = sub_filter_start_end(sizes[0], k)
                state[key][:, :, start:end, start:end] = dconv.get_active_filter(m, k).detach().cpu()
                name = f"blocks.{bi}.conv.depth_conv.conv.{src}to{k}_matrix"
                state[name] = torch.eye(state[name].shape[0], dtype=state[name].dtype)
    return state


__all__ = [
    "IndexMap",
    "extract",
    "fold_kernel_transforms",
    "is_kernel_matrix",
    "masked_average",
    "middle_channels",
    "nas_index_map",
    "prefix_index_map",
    "roll_middle_channels",
    "rolled",
    "smallest_kernels",
]
