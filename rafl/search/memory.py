"""Activation memory of inference and training, from the traced graph and from measurement.

* :func:`fx_peak_memory` — *estimate*: trace a model with ``torch.fx``, propagate shapes, build the
  data-flow graph as a ``networkx.DiGraph``, merge aliases (views, in-place ops, identities) and
  sweep the execution order: a tensor is live from the step that produces it to the last step that
  reads it (or any alias of it); the peak is the maximum over steps of the live bytes (batch 1,
  float32 unless the graph says otherwise). This is the lifetime analysis of memory planners such as
  MCUNet's (Lin et al., "MCUNet: Tiny Deep Learning on IoT Devices", NeurIPS 2020, Sec. 3.1: peak
  SRAM = max over layers of the live activations) or TFLite Micro's arena planner.
* :func:`measure_peak_memory` — *measurement* on CPU: run a model eagerly under a
  ``TorchDispatchMode`` that records every storage each ATen op creates and frees it when the last
  tensor on it is garbage-collected; reports the maximum live activation bytes (weights excluded).
* :func:`measure_saved_activations` — *measurement* of what autograd keeps for the backward pass
  (``torch.autograd.graph.saved_tensors_hooks``), unique storages, weights excluded.

The cost model's fast path (:mod:`rafl.search.cost`) applies these per unit (OFA layer) once per
(space, resolution) and combines them: in a chain of units only one unit is executing, so the
network's peak is the maximum of the units' peaks (plus the caller-owned network input).
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTrace", "fx_peak_memory", "measure_peak_memory", "measure_saved_activations",
           "SubnetBody"]

_VIEW_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "expand", "permute", "transpose",
                 "contiguous", "view_as", "expand_as", "detach"}
_VIEW_FUNCS = {torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze, torch.permute,
               torch.transpose, operator.getitem}
_INPLACE_METHODS_SUFFIX = "_"


@dataclass
class MemoryTrace:
    """Result of :func:`fx_peak_memory`.

    Attributes:
        peak_bytes: maximum live activation bytes over the execution order.
        peak_node: name of the fx node executing at the peak.
        order: node names in execution order (tensor-producing and aliasing nodes).
        live_bytes: live bytes at each step of ``order``.
        out_bytes: bytes newly allocated by each node (0 for views / in-place ops).
        graph: the ``networkx.DiGraph`` of data flow (node attrs: ``bytes``, ``step``, ``alias_of``).
        peak_bytes_held / peak_bytes_freed: the peak with the input held for the whole pass / freed
            after its last use (one of them equals ``peak_bytes``).
    """

    peak_bytes: int
    peak_node: str
    order: list[str] = field(default_factory=list)
    live_bytes: list[int] = field(default_factory=list)
    out_bytes: dict[str, int] = field(default_factory=dict)
    graph: Any = None  # networkx.DiGraph
    peak_bytes_held: int = 0
    peak_bytes_freed: int = 0

    @property
    def peak_mb(self) -> float:
        """Peak in MiB."""
        return self.peak_bytes / 2**20


def _tensor_bytes(node: torch.fx.Node) -> int:
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        return 0
    numel = 1
    for s in meta.shape:
        numel *= int(s)
    return numel * torch.empty((), dtype=meta.dtype).element_size()


def _is_alias(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Does ``node`` return (a view of) its first input rather than a new tensor?"""
    if node.op == "call_method":
        return node.target in _VIEW_METHODS or str(node.target).endswith(_INPLACE_METHODS_SUFFIX)
    if node.op == "call_function":
        if node.target in _VIEW_FUNCS:
            return True
        return bool(node.kwargs.get("inplace", False))
    if node.op == "call_module":
        mod = gm.get_submodule(str(node.target))
        if isinstance(mod, (nn.Identity, nn.Flatten)):
            return True
        if isinstance(mod, nn.Dropout) and not mod.training:
            return True
        return bool(getattr(mod, "inplace", False))
    return False


def fx_peak_memory(model: nn.Module, input_shape: tuple[int, ...], *, hold_input: bool = True,
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> MemoryTrace:
    """Peak live activation memory of one forward pass, by tensor-lifetime analysis of the fx graph.

    Args:
        model: a module that ``torch.fx.symbolic_trace`` can trace (an extracted subnet, an ofa
            layer). Put it in eval mode for inference memory.
        input_shape: shape of the input tensor, e.g. ``(1, 3, 32, 32)`` (batch 1 for the budget).
        hold_input: count the input as live for the whole pass (the caller owns that buffer);
            False frees it after its last use like any other tensor.
        dtype: input dtype (float32).
        device: device of the shape-propagation input; ``"meta"`` (with a model built on the meta
            device) propagates shapes without allocating or computing anything.

    Returns:
        :class:`MemoryTrace`; weights and buffers are not counted (they are parameters).

    Raises:
        torch.fx.proxy.TraceError: if the model has data-dependent control flow.
    """
    gm = torch.fx.symbolic_trace(model)
    was_training = gm.training
    with torch.no_grad():
        ShapeProp(gm).propagate(torch.zeros(input_shape, dtype=dtype, device=device))
    gm.train(was_training)

    nodes = [n for n in gm.graph.nodes]
    import networkx as nx  # noqa: PLC0415 - networkx: ~10 MB resident, loaded only when a peak is estimated

    graph = nx.DiGraph()
    for step, n in enumerate(nodes):
        graph.add_node(n.name, step=step, bytes=_tensor_bytes(n), op=n.op)
    for n in nodes:
        for u in n.users:
            graph.add_edge(n.name, u.name)
    if not nx.is_directed_acyclic_graph(graph):  # fx graphs always are; guard the sweep below
        raise ValueError("traced graph has a cycle")

    # aliases share the storage of their root: union them in an undirected alias graph
    alias = nx.Graph()
    alias.add_nodes_from(graph.nodes)
    for n in nodes:
        if _is_alias(n, gm) and n.args and isinstance(n.args[0], torch.fx.Node):
            alias.add_edge(n.name, n.args[0].name)
            graph.nodes[n.name]["alias_of"] = n.args[0].name

    step_of = {n.name: i for i, n in enumerate(nodes)}
    last = len(nodes) - 1
    intervals: list[tuple[int, int, int, bool]] = []  # (alloc step, free step, bytes, is input)
    out_bytes: dict[str, int] = {}
    for comp in nx.connected_components(alias):
        comp = sorted(comp, key=step_of.__getitem__)
        root = comp[0]
        size = graph.nodes[root]["bytes"]
        for name in comp:
            out_bytes[name] = size if name == root else 0
        if graph.nodes[root]["op"] in ("get_attr", "output") or size == 0:
            continue
        end = max([step_of[root]] + [step_of[s] for name in comp for s in graph.successors(name)])
        if any(graph.nodes[s]["op"] == "output" for name in comp for s in graph.successors(name)):
            end = last
        intervals.append((step_of[root], end, size, graph.nodes[root]["op"] == "placeholder"))

    def sweep(hold: bool) -> list[int]:
        live = [0] * len(nodes)
        for start, end, size, is_input in intervals:
            for s in range(start, (last if (is_input and hold) else end) + 1):
                live[s] += size
        return live

    live = sweep(hold_input)
    other = sweep(not hold_input)
    peak_step = max(range(len(nodes)), key=live.__getitem__)
    for n, b in zip(nodes, live):
        graph.nodes[n.name]["live_bytes"] = b
    return MemoryTrace(peak_bytes=live[peak_step], peak_node=nodes[peak_step].name,
                       order=[n.name for n in nodes], live_bytes=live, out_bytes=out_bytes, graph=graph,
                       peak_bytes_held=max(live if hold_input else other),
                       peak_bytes_freed=max(other if hold_input else live))


class SubnetBody(nn.Module):
    """The forward pass of a ``rafl.supernet.Subnet`` on an already prepared ``(B, 3, r, r)`` input,
    without the input checks/resizing that ``torch.fx`` cannot trace (they are no-ops at size r).

    Shapes: ``(B, 3, r, r) -> (B, n_classes)``; shares the subnet's modules (no copy).
    """

    def __init__(self, subnet: nn.Module):
        super().__init__()
        self.first_conv = subnet.first_conv
        self.blocks = subnet.blocks
        self.final_expand_layer = subnet.final_expand_layer
        self.feature_mix_layer = subnet.feature_mix_layer
        self.head = subnet.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first_conv(x)
        for block in self.blocks:
            x = block(x)
        x = self.final_expand_layer(x)
        x = x.mean((2, 3), keepdim=True)
        return self.head(self.feature_mix_layer(x).flatten(1))


class _LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of live activation storages created by ATen ops (weights excluded)."""

    def __init__(self, exclude_ptrs: set[int]):
        super().__init__()
        self.exclude = exclude_ptrs
        self.owners: dict[int, set[int]] = {}   # storage ptr -> ids of live tensors on it
        self.sizes: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0 or ptr in self.exclude:
            return
        owners = self.owners.setdefault(ptr, set())
        if id(t) in owners:
            return
        if not owners:
            self.sizes[ptr] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        owners.add(id(t))
        weakref.finalize(t, self._release, ptr, id(t))

    def _release(self, ptr: int, tid: int) -> None:
        owners = self.owners.get(ptr)
        if not owners or tid not in owners:
            return
        owners.discard(tid)
        if not owners:
            self.current -= self.sizes.pop(ptr)
            del self.owners[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.track(t)
        return out


def measure_peak_memory(model: nn.Module, x: torch.Tensor) -> int:
    """Measured peak live activation bytes of ``model(x)`` on CPU (inference, no autograd).

    The input counts as live for the whole pass (the caller holds it). Python references decide
    when tensors die, so an eager ``nn.Module`` may keep tensors alive longer than the fx lifetime
    analysis assumes; a ``torch.fx.GraphModule`` frees every value after its last use (fx codegen),
    so measuring the traced module checks :func:`fx_peak_memory` exactly.

    Args:
        model: any module (eval mode for inference).
        x: input, e.g. shape ``(1, 3, r, r)``.

    Returns:
        peak bytes (int).
    """
    exclude = {p.untyped_storage().data_ptr() for p in model.parameters()}
    exclude |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    tracker = _LiveTensorTracker(exclude)
    with torch.no_grad():
        tracker.track(x)
        with tracker:
            out = model(x)
        del out
    return tracker.peak


def measure_saved_activations(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for the backward pass of ``model(x)`` (train mode, unique storages,
    parameters excluded). It grows linearly with the batch (plus a small batch-independent part:
    BatchNorm's per-channel batch statistics).

    Args:
        model: module in the mode to measure (train mode for training memory).
        x: input, shape ``(B, ...)`` (on the model's device; ``meta`` works: nothing is computed).

    Returns:
        saved bytes (int).
    """
    # storages are identified by their StorageImpl (works on the meta device too, where every
    # data_ptr is 0): a view and its base count once
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(seen.values())
