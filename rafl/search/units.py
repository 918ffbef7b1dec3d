"""The layers ("units") of a subnet of the OFA MobileNet-V3 space, as data.

A *unit* is one OFA layer, the granularity of OFA's latency lookup tables (Cai et al.,
"Once-for-All", ICLR 2020, Sec. 3.3; ``ofa/nas/efficiency_predictor/latency_lookup_table.py``):
the stem convolution, one inverted-residual (MBConv) block, the final expand convolution, the
global-average-pool + feature-mix convolution, and the classifier. Every unit's cost depends only
on its :class:`UnitSpec` (channels, kernel, stride, input size, ...), so the cost model prices a
subnet by summing per-unit table entries.

The units are read off the same macro-architecture data the supernet is built from,
:func:`rafl.supernet.arch.network_layout` (channels per layer, strides, activations, SE), with
block mid channels ``make_divisible(round(in_ch * e), 8)``
(:meth:`~rafl.supernet.arch.BlockLayout.mid_channels`) and SE mid channels
``make_divisible(mid // 4, 8)`` as in ofa's layers. MACs count the multiply-adds of convolutions
and linear layers only (bias additions, BN, activations, pooling and the SE gating multiply are not
counted; this is what fvcore counts for ``aten::_convolution`` / ``aten::linear``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
from ofa.utils.layers import IdentityLayer, ResidualBlock, set_layer_from_config
from torch import nn

from rafl.supernet.arch import ArchConfig, SearchSpace, make_divisible, network_layout

__all__ = ["UnitSpec", "arch_units", "slot_units", "fixed_units", "block_unit", "out_size",
           "build_unit_module", "unit_input_shape", "GapConv"]


def out_size(h: int, stride: int) -> int:
    """Output side of a 'same'-padded convolution with an odd kernel: ceil(h / stride)."""
    return (h - 1) // stride + 1


@dataclass(frozen=True)
class UnitSpec:
    """One OFA layer of a subnet.

    Attributes:
        kind: ``"conv"`` (ConvLayer: conv + BN + act), ``"mbconv"`` (MBConvLayer, optionally in a
            residual block), ``"gap_conv"`` (global average pool, then a 1x1 ConvLayer without BN
            or bias: OFA's feature-mix layer) or ``"linear"`` (the classifier, with bias).
        cin, cout: input / output channels (features for ``linear``).
        kernel: kernel size (1 for 1x1 convs and linear).
        stride: stride of the (depthwise) convolution.
        hin: input side in pixels (square; 1 for linear).
        mid: MBConv expanded channels (== cin when there is no expansion layer).
        expand: True if the MBConv has the 1x1 expansion (inverted bottleneck) conv.
        se: squeeze-and-excitation on the depthwise output.
        act: activation (``relu`` / ``h_swish`` / ``none``).
        residual: identity shortcut (stride 1 and cin == cout).
        use_bn: BatchNorm after the conv (``conv`` kind).
    """

    kind: str
    cin: int
    cout: int
    kernel: int = 1
    stride: int = 1
    hin: int = 1
    mid: int = 0
    expand: bool = False
    se: bool = False
    act: str = "none"
    residual: bool = False
    use_bn: bool = True

    # ----------------------------------------------------------------- geometry
    @property
    def hout(self) -> int:
        """Output side in pixels (1 after global pooling / for linear)."""
        if self.kind in ("gap_conv", "linear"):
            return 1
        return out_size(self.hin, self.stride)

    @property
    def se_mid(self) -> int:
        """Channels of the SE bottleneck (OFA SEModule, reduction 4)."""
        return make_divisible(self.mid // 4, 8) if self.se else 0

    @property
    def key(self) -> str:
        """Stable string key of this configuration (the latency-LUT key)."""
        if self.kind == "mbconv":
            return (f"mbconv-c{self.cin}-m{self.mid}-o{self.cout}-k{self.kernel}-s{self.stride}-h{self.hin}"
                    f"-x{int(self.expand)}-se{int(self.se)}-{self.act}-res{int(self.residual)}")
        if self.kind == "conv":
            return (f"conv-c{self.cin}-o{self.cout}-k{self.kernel}-s{self.stride}-h{self.hin}"
                    f"-bn{int(self.use_bn)}-{self.act}")
        if self.kind == "gap_conv":
            return f"gap_conv-c{self.cin}-o{self.cout}-h{self.hin}-{self.act}"
        return f"linear-i{self.cin}-o{self.cout}"

    @property
    def memory_key(self) -> tuple:
        """Key of everything that affects activation memory (the kernel size does not)."""
        d = asdict(self)
        d.pop("kernel")
        return tuple(d.values())

    def describe(self) -> str:
        """Short human-readable type, e.g. ``MBConv k5 e(72) SE h_swish``."""
        if self.kind == "mbconv":
            return (f"MBConv k{self.kernel} s{self.stride} mid{self.mid}{' SE' if self.se else ''}"
                    f" {self.act}{' +res' if self.residual else ''}")
        if self.kind == "conv":
            return f"Conv k{self.kernel} s{self.stride}{' BN' if self.use_bn else ''} {self.act}"
        if self.kind == "gap_conv":
            return f"GAP + Conv 1x1 {self.act}"
        return "Linear"

    # ----------------------------------------------------------------- ops
    def ops(self) -> list[tuple[str, int, int, int, int, int, int]]:
        """The conv/linear operations of this unit, in execution order.

        Returns:
            list of ``(name, cin, cout, kernel, groups, hin, hout)``: one entry per convolution or
            linear layer (names follow the ofa module names: ``inverted_bottleneck``,
            ``depth_conv``, ``se.reduce``, ``se.expand``, ``point_linear``, ``conv``, ``linear``).
        """
        h, ho = self.hin, self.hout
        if self.kind == "conv":
            return [("conv", self.cin, self.cout, self.kernel, 1, h, ho)]
        if self.kind == "gap_conv":
            return [("conv", self.cin, self.cout, 1, 1, 1, 1)]
        if self.kind == "linear":
            return [("linear", self.cin, self.cout, 1, 1, 1, 1)]
        out = []
        if self.expand:
            out.append(("inverted_bottleneck", self.cin, self.mid, 1, 1, h, h))
        out.append(("depth_conv", self.mid, self.mid, self.kernel, self.mid, h, ho))
        if self.se:
            out.append(("se.reduce", self.mid, self.se_mid, 1, 1, 1, 1))
            out.append(("se.expand", self.se_mid, self.mid, 1, 1, 1, 1))
        out.append(("point_linear", self.mid, self.cout, 1, 1, ho, ho))
        return out

    def macs(self) -> int:
        """Multiply-adds of the unit's convolutions and linear layers (batch 1)."""
        return sum(cout * (cin // g) * k * k * ho * ho for _, cin, cout, k, g, _, ho in self.ops())

    def params(self) -> int:
        """Trainable parameters: conv/linear weights, their biases, BN affine weights (2 x C)."""
        n = 0
        for name, cin, cout, k, g, _, _ in self.ops():
            n += cout * (cin // g) * k * k
            if name.startswith("se.") or name == "linear":
                n += cout  # bias
            elif self.kind == "mbconv" or (self.kind == "conv" and self.use_bn):
                n += 2 * cout  # BN gamma, beta
        return n

    def op_bytes(self, bytes_per_element: int = 4) -> list[tuple[int, int]]:
        """Per op ``(macs, bytes)``: bytes = input + output activations + weights (the roofline
        traffic of an op that streams its operands from DRAM once)."""
        out = []
        for _, cin, cout, k, g, h, ho in self.ops():
            macs = cout * (cin // g) * k * k * ho * ho
            elems = cin * h * h + cout * ho * ho + cout * (cin // g) * k * k
            out.append((macs, elems * bytes_per_element))
        return out

    def out_elements(self) -> int:
        """Elements of the unit's output activation (batch 1)."""
        return self.cout * self.hout * self.hout

    def ofa_config(self) -> dict:
        """The ofa layer config (``set_layer_from_config``) of this unit, without the residual wrapper."""
        if self.kind == "mbconv":
            return {"name": "MBConvLayer", "in_channels": self.cin, "out_channels": self.cout,
                    "kernel_size": self.kernel, "stride": self.stride,
                    "expand_ratio": (self.mid / self.cin) if self.expand else 1,
                    "mid_channels": self.mid if self.expand else None, "act_func": self.act,
                    "use_se": self.se}
        if self.kind == "conv":
            return {"name": "ConvLayer", "in_channels": self.cin, "out_channels": self.cout,
                    "kernel_size": self.kernel, "stride": self.stride, "use_bn": self.use_bn,
                    "act_func": self.act, "bias": False}
        if self.kind == "gap_conv":
            return {"name": "ConvLayer", "in_channels": self.cin, "out_channels": self.cout,
                    "kernel_size": 1, "stride": 1, "use_bn": False, "act_func": self.act, "bias": False}
        return {"name": "LinearLayer", "in_features": self.cin, "out_features": self.cout, "bias": True}


@lru_cache(maxsize=256)
def _block_sides(space: SearchSpace, r: int) -> tuple[int, ...]:
    """Per block slot, its input side in pixels at resolution ``r``.

    Only a stage's first slot has a stride other than 1, so a slot's input side depends only on
    its stage (inactive later blocks of a stage do not change sizes)."""
    h = out_size(r, space.stem_stride)  # stem; the first block has stride 1
    sides = []
    for block in network_layout(space).blocks:
        sides.append(h)
        h = out_size(h, block.stride)
    return tuple(sides)


def block_unit(space: SearchSpace, r: int, slot: int, ks: int, e: int) -> UnitSpec:
    """The MBConv unit of block slot ``slot`` with kernel ``ks`` and expand ratio ``e`` at resolution ``r``."""
    b = network_layout(space).blocks[slot]
    return UnitSpec(kind="mbconv", cin=b.cin, cout=b.cout, kernel=ks, stride=b.stride, hin=_block_sides(space, r)[slot],
                    mid=b.mid_channels(e), expand=True, se=b.se, act=b.act, residual=b.residual)


def fixed_units(space: SearchSpace, r: int) -> tuple[list[tuple[str, UnitSpec]], list[tuple[str, UnitSpec]]]:
    """The units every subnet has: ``(head_units, tail_units)``.

    head: ``first_conv`` (stem, 3x3, ``stem_stride``, BN, h_swish) and ``blocks.0`` (the first
    MBConv: 3x3 depthwise, expand ratio 1, ReLU, identity shortcut when widths match).
    tail: ``final_expand_layer`` (1x1, BN, h_swish), ``feature_mix_layer`` (global average pool,
    1x1 conv without BN/bias, h_swish) and ``head`` (the classifier: linear with bias).
    """
    layout = network_layout(space)
    stem, fb, fe, fm = layout.stem, layout.first_block, layout.final_expand, layout.feature_mix
    h0 = out_size(r, stem.stride)
    head = [
        ("first_conv", UnitSpec(kind="conv", cin=stem.cin, cout=stem.cout, kernel=stem.kernel, stride=stem.stride,
                                hin=r, act=stem.act, use_bn=stem.use_bn)),
        ("blocks.0", UnitSpec(kind="mbconv", cin=fb.cin, cout=fb.cout, kernel=fb.kernel, stride=fb.stride, hin=h0,
                              mid=round(fb.cin * fb.expand_ratio), expand=fb.expand_ratio != 1, se=fb.se, act=fb.act,
                              residual=fb.residual)),
    ]
    h = h0
    for block in layout.blocks:
        h = out_size(h, block.stride)
    tail = [
        ("final_expand_layer", UnitSpec(kind="conv", cin=fe.cin, cout=fe.cout, kernel=fe.kernel, stride=fe.stride,
                                        hin=h, act=fe.act, use_bn=fe.use_bn)),
        ("feature_mix_layer", UnitSpec(kind="gap_conv", cin=fm.cin, cout=fm.cout, hin=h, act=fm.act,
                                       use_bn=fm.use_bn)),
        ("head", UnitSpec(kind="linear", cin=fm.cout, cout=layout.n_classes)),
    ]
    return head, tail


def slot_units(space: SearchSpace, r: int) -> list[list[list[UnitSpec]]]:
    """``[slot][ks_index][e_index] -> UnitSpec`` for every block slot of ``space`` at resolution ``r``."""
    return [[[block_unit(space, r, i, k, e) for e in space.e_choices] for k in space.ks_choices]
            for i in range(space.n_blocks)]


def arch_units(space: SearchSpace, arch: ArchConfig) -> list[tuple[str, UnitSpec]]:
    """The units of subnet ``arch`` in execution order, named like the ofa/extracted modules
    (``first_conv``, ``blocks.<n>``, ``final_expand_layer``, ``feature_mix_layer``, ``head``).

    Raises:
        UserInputError: if ``arch`` does not belong to ``space``.
    """
    arch.validate(space)
    head, tail = fixed_units(space, arch.r)
    units = list(head)
    n = 1
    for i in arch.active_blocks(space):
        units.append((f"blocks.{n}", block_unit(space, arch.r, i, arch.ks[i], arch.e[i])))
        n += 1
    units.extend(tail)
    return units


class GapConv(nn.Module):
    """Global average pooling (``x.mean((2, 3))``, as ``rafl.supernet.Subnet.features``) followed
    by the feature-mix conv. Shapes: ``(B, C, H, W) -> (B, C_out, 1, 1)``."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.mean((2, 3), keepdim=True))


def build_unit_module(spec: UnitSpec):
    """A standalone ``torch.nn.Module`` of this unit built with the ofa layers (random weights).

    ``mbconv`` -> ``ofa.utils.layers.ResidualBlock(MBConvLayer, IdentityLayer | None)``;
    ``conv`` -> ``ConvLayer``; ``gap_conv`` -> OFA's ``mean(3).mean(2)`` pooling + ``ConvLayer``;
    ``linear`` -> ``LinearLayer`` (input ``(B, C)``). Used to measure memory and latency per unit.
    """
    layer = set_layer_from_config(spec.ofa_config())
    if spec.kind == "mbconv":
        shortcut = IdentityLayer(spec.cin, spec.cin) if spec.residual else None
        return ResidualBlock(layer, shortcut)
    if spec.kind == "gap_conv":
        return GapConv(layer)
    return layer


def unit_input_shape(spec: UnitSpec, batch: int = 1) -> tuple[int, ...]:
    """Input shape of the unit's module: ``(B, cin, hin, hin)`` or ``(B, cin)`` for linear."""
    return (batch, spec.cin) if spec.kind == "linear" else (batch, spec.cin, spec.hin, spec.hin)
