"""The once-for-all MobileNet-V3 supernet for small images, and standalone subnets cut from it.

Built on the ``ofa`` package's elastic layers (Cai et al., "Once-for-All: Train One Network and
Specialize it for Efficient Deployment", ICLR 2020, Sec. 3): :class:`Supernet` subclasses
``ofa``'s ``OFAMobileNetV3`` and reuses its ``DynamicMBConvLayer`` blocks (elastic kernel via the
kernel transformation matrices of Sec. 3.2, elastic expand ratio by channel slicing, elastic depth
by skipping the last blocks of a stage) and its ``get_active_subnet`` extraction.

Adaptation to small (CIFAR-sized, 32 px) inputs
-----------------------------------------------
OFA's ImageNet network has a stride-2 stem and stage strides (2, 2, 2, 1, 2) (total stride 32
for 224 px). Here the stem stride is ``SearchSpace.stem_stride`` (default 1) and the stage strides
are ``SearchSpace.stage_strides`` (default OFA's (2, 2, 2, 1, 2)), so a 32 px input goes
32 (stem) -> 32 (first block, stride 1) -> 16 -> 8 -> 4 -> 4 -> 2 px (total stride 16).

The macro-architecture is data: :data:`rafl.supernet.arch.OFA_MOBILENET_V3` (widths before the
width multiplier ``w``: stem 16, first block 16, stages (24, 40, 80, 112, 160), final expand 960,
feature mix 1280; activations and SE per stage), decoded for a search space by
:func:`rafl.supernet.arch.network_layout` (``make_divisible(width * w, 8)`` as in OFA). The
supernet's modules are built from that layout, and the cost model (:mod:`rafl.search.units`)
prices the same layout.

Representation and classifier
-----------------------------
``features(x)`` is the output of OFA's feature-mix layer after global average pooling:
``(B, D)`` with ``D = make_divisible(1280 * w)`` (e.g. 1280 at ``w=1``, 448 at ``w=0.35``), the
same for every subnet. This is the representation FedGH / FedTGP / FedProto exchange. The
classifier ("header" in FedGH) is OFA's ``LinearLayer``: dropout, then ``Linear(D, n_classes)``.

Active-subnet state
-------------------
``ofa`` keeps the active subnet as mutable module attributes. Here every public call takes an
:class:`~rafl.supernet.arch.ArchConfig` and restores the previous state afterwards
(:meth:`Supernet.active`), so callers never see that state.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from ofa.imagenet_classification.elastic_nn.modules.dynamic_layers import DynamicMBConvLayer
from ofa.imagenet_classification.elastic_nn.networks import OFAMobileNetV3
from ofa.imagenet_classification.networks import MobileNetV3
from ofa.utils.layers import ConvLayer, IdentityLayer, LinearLayer, MBConvLayer, ResidualBlock
from ofa.utils.my_modules import init_models
from torch import Tensor, nn

from rafl.errors import UserInputError
from rafl.supernet.arch import OFA_MOBILENET_V3, ArchConfig, SearchSpace, network_layout


def feature_dim_of(space: SearchSpace) -> int:
    """``D``, the width of the representation of every subnet of ``space``."""
    return network_layout(space).feature_dim


def resize_input(x: Tensor, r: int) -> Tensor:
    """Resize a ``(B, C, H, W)`` batch to ``(B, C, r, r)`` (bilinear; unchanged if already r x r)."""
    if x.dim() != 4:
        raise UserInputError(f"expected a (B, C, H, W) image batch, got shape {tuple(x.shape)}",
                             field="input")
    if x.shape[-1] == r and x.shape[-2] == r:
        return x
    return F.interpolate(x, size=(r, r), mode="bilinear", align_corners=False)


def prepare_input(x: Tensor, r: int) -> Tensor:
    """``(B, C, H, W)`` with C in {1, 3} -> ``(B, 3, r, r)`` (grayscale repeated to 3 channels).

    On the CPU the batch is laid out channels-last (``torch.channels_last``; the shape is unchanged):
    oneDNN's depthwise and 1x1 convolutions then run about 2x faster than on NCHW for the largest
    subnets, forward and backward (``bench/channels_last.py``); every layer after the first keeps
    that layout, the weights keep theirs.
    """
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise UserInputError(
            f"expected a (B, 3, H, W) or (B, 1, H, W) image batch, got shape {tuple(x.shape)}",
            field="input")
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = resize_input(x, r)
    return x.contiguous(memory_format=torch.channels_last) if x.device.type == "cpu" else x


class Supernet(OFAMobileNetV3):
    """OFA MobileNet-V3 supernet with elastic kernel, expand ratio, depth and resolution.

    Build it with :func:`build_supernet`. ``forward(x, arch)`` maps an image batch
    ``(B, 3, H, W)`` (any H, W; resized to ``arch.r``) to logits ``(B, n_classes)`` of subnet
    ``arch`` (``None``: the largest subnet). ``features(x, arch)`` gives the ``(B, D)``
    representation. Neither leaves any active-subnet state behind.

    Attributes:
        space: the :class:`SearchSpace` it was built for.
        feature_dim: ``D`` (see the module docstring).

    Raises:
        UserInputError: an arch that does not belong to ``space`` (named field and allowed values).
    """

    def __init__(self, space: SearchSpace):  # noqa: D107 - documented on the class
        macro = OFA_MOBILENET_V3
        if space.n_stages != len(macro.stages):
            raise UserInputError(
                f"is {space.n_stages}; the OFA MobileNet-V3 supernet has {len(macro.stages)} "
                "elastic stages", field="search_space.n_stages")
        layout = network_layout(space, macro)
        self.width_mult = space.width_mult
        self.ks_list = list(space.ks_choices)
        self.expand_ratio_list = list(space.e_choices)
        self.depth_list = list(space.d_choices)

        stem, fb = layout.stem, layout.first_block
        first_conv = ConvLayer(stem.cin, stem.cout, kernel_size=stem.kernel, stride=stem.stride, use_bn=stem.use_bn,
                               act_func=stem.act)
        first_block = ResidualBlock(
            MBConvLayer(fb.cin, fb.cout, kernel_size=fb.kernel, stride=fb.stride, expand_ratio=fb.expand_ratio,
                        act_func=fb.act, use_se=fb.se),
            IdentityLayer(fb.cin, fb.cin) if fb.residual else None,
        )
        blocks: list[nn.Module] = [first_block]
        for b in layout.blocks:
            layer = DynamicMBConvLayer([b.cin], [b.cout], kernel_size_list=self.ks_list,
                                       expand_ratio_list=self.expand_ratio_list, stride=b.stride,
                                       act_func=b.act, use_se=b.se)
            blocks.append(ResidualBlock(layer, IdentityLayer(b.cin, b.cin) if b.residual else None))
        d = space.max_depth
        self.block_group_info = [list(range(1 + s * d, 1 + (s + 1) * d)) for s in range(space.n_stages)]
        fe, fm = layout.final_expand, layout.feature_mix
        final_expand_layer = ConvLayer(fe.cin, fe.cout, kernel_size=fe.kernel, use_bn=fe.use_bn, act_func=fe.act)
        feature_mix_layer = ConvLayer(fm.cin, fm.cout, kernel_size=fm.kernel, bias=False, use_bn=fm.use_bn,
                                      act_func=fm.act)
        classifier = LinearLayer(layout.feature_dim, layout.n_classes, dropout_rate=layout.dropout)
        # Skip OFAMobileNetV3.__init__ (ImageNet strides hard-coded); build the same module tree.
        MobileNetV3.__init__(self, first_conv, blocks, final_expand_layer, feature_mix_layer, classifier)
        self.set_bn_param(momentum=macro.bn_momentum, eps=macro.bn_eps)
        self.runtime_depth = [len(idx) for idx in self.block_group_info]
        self.space = space
        self.feature_dim = layout.feature_dim

    # ----------------------------------------------------------------- active-subnet state
    def _get_state(self) -> tuple[list[int], list[int], list[int]]:
        ks = [blk.conv.active_kernel_size for blk in self.blocks[1:]]
        e = [blk.conv.active_expand_ratio for blk in self.blocks[1:]]
        return ks, e, list(self.runtime_depth)

    def _set_state(self, ks: list[int], e: list[int], d: list[int]) -> None:
        for blk, k, ratio in zip(self.blocks[1:], ks, e):
            blk.conv.active_kernel_size = k
            blk.conv.active_expand_ratio = ratio
        self.runtime_depth = list(d)

    @contextlib.contextmanager
    def active(self, arch: ArchConfig | None) -> Iterator[ArchConfig]:
        """Context in which ``arch`` (validated; ``None`` = largest) is ofa's active subnet.

        The previous active state is restored on exit, also on error.
        """
        arch = self.space.largest() if arch is None else arch.validate(self.space)
        saved = self._get_state()
        self._set_state(list(arch.ks), list(arch.e), list(arch.d))
        try:
            yield arch
        finally:
            self._set_state(*saved)

    # ----------------------------------------------------------------- forward
    def _features_active(self, x: Tensor) -> Tensor:
        x = self.first_conv(x)
        x = self.blocks[0](x)
        for stage, block_idx in enumerate(self.block_group_info):
            for idx in block_idx[: self.runtime_depth[stage]]:
                x = self.blocks[idx](x)
        x = self.final_expand_layer(x)
        x = x.mean((2, 3), keepdim=True)
        x = self.feature_mix_layer(x)
        return x.flatten(1)

    def features(self, x: Tensor, arch: ArchConfig | None = None) -> Tensor:
        """Representation ``(B, D)`` of subnet ``arch`` for images ``(B, 3, H, W)``."""
        with self.active(arch) as a:
            return self._features_active(prepare_input(x, a.r))

    def forward(self, x: Tensor, arch: ArchConfig | None = None) -> Tensor:  # type: ignore[override]
        """Logits ``(B, n_classes)`` of subnet ``arch`` (None: largest) for ``(B, 3, H, W)`` images."""
        with self.active(arch) as a:
            return self.classifier(self._features_active(prepare_input(x, a.r)))

    @property
    def head(self) -> nn.Module:
        """The classifier ``(B, D) -> (B, n_classes)`` shared by all subnets."""
        return self.classifier

    def sample_active_subnet(self):  # type: ignore[override]
        raise RuntimeError("rafl's Supernet has no mutable active subnet; use space.sample(rng) "
                           "and forward(x, arch)")


class Subnet(nn.Module):
    """A standalone, static subnet (copied weights; no elastic layers), from :func:`extract_subnet`.

    ``features(x)``: images ``(B, C, H, W)`` (any H, W; resized to ``arch.r``) -> ``(B, D)``.
    ``head``: the classifier ``(B, D) -> (B, n_classes)`` (dropout + linear; FedGH's "header").
    ``forward(x) = head(features(x))``: ``(B, n_classes)`` logits.

    Attributes:
        arch: the subnet's :class:`ArchConfig`.
        space: the search space it was cut from.
        feature_dim: ``D``.
    """

    def __init__(self, arch: ArchConfig, space: SearchSpace, first_conv: nn.Module,
                 blocks: Iterable[nn.Module], final_expand_layer: nn.Module,
                 feature_mix_layer: nn.Module, head: nn.Module):  # noqa: D107
        super().__init__()
        self.arch = arch
        self.space = space
        self.feature_dim = feature_dim_of(space)
        self.first_conv = first_conv
        self.blocks = nn.ModuleList(blocks)
        self.final_expand_layer = final_expand_layer
        self.feature_mix_layer = feature_mix_layer
        self.head = head

    def features(self, x: Tensor) -> Tensor:
        """Representation ``(B, D)`` of images ``(B, 3, H, W)``."""
        x = self.first_conv(prepare_input(x, self.arch.r))
        for block in self.blocks:
            x = block(x)
        x = self.final_expand_layer(x)
        x = x.mean((2, 3), keepdim=True)
        return self.feature_mix_layer(x).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        """Logits ``(B, n_classes)``."""
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return f"arch={self.arch.to_string(self.space)}, feature_dim={self.feature_dim}"


def build_supernet(space: SearchSpace, zero_last_gamma: bool = True) -> Supernet:
    """A freshly initialised :class:`Supernet` for ``space`` (ofa's weight init: He-normal convs).

    With ``zero_last_gamma`` the last BN of every residual block starts at gamma = 0, so each block
    starts as the identity (Goyal et al., "Accurate, Large Minibatch SGD", 2017, Sec. 5.1; ofa's
    ``MobileNetV3.zero_last_gamma``): the deep supernet trains much faster from scratch.

    Raises:
        UserInputError: ``space.n_stages`` is not 5 (the OFA MobileNet-V3 macro-architecture).
    """
    net = Supernet(space)
    init_models(net, "he_fout")
    if zero_last_gamma:
        for block in net.blocks[1:]:
            if isinstance(block.shortcut, IdentityLayer):
                block.conv.point_linear.bn.bn.weight.data.zero_()
    return net


def extract_subnet(supernet: Supernet, arch: ArchConfig) -> Subnet:
    """Cut subnet ``arch`` out of ``supernet`` as a standalone :class:`Subnet` with copied weights.

    Uses ofa's ``get_active_subnet`` (OFA Sec. 3.2: the kernel-transformed depthwise filters, the
    first ``round(e * C_in)`` channels of each expansion, the first ``d`` blocks of each stage). In
    eval mode its outputs equal ``supernet(x, arch)`` (tested: max abs difference <= 1e-5). The
    subnet is in the supernet's train/eval mode, on its device; the supernet is left unchanged.

    Raises:
        UserInputError: ``arch`` does not belong to ``supernet.space``.
    """
    with supernet.active(arch) as a, torch.no_grad():
        static = supernet.get_active_subnet(preserve_weight=True)
    sub = Subnet(a, supernet.space, static.first_conv, static.blocks, static.final_expand_layer,
                 static.feature_mix_layer, static.classifier)
    sub.train(supernet.training)
    return sub.to(next(supernet.parameters()).device)


def _slice_conv(conv: nn.Conv2d, out_idx: Tensor | None = None, in_idx: Tensor | None = None) -> nn.Conv2d:
    """A copy of ``conv`` keeping output channels ``out_idx`` and input channels ``in_idx``
    (``None``: all). A depthwise conv (``groups == in == out``) is sliced by ``out_idx`` only."""
    depthwise = conv.groups > 1 and conv.groups == conv.in_channels == conv.out_channels
    w = conv.weight if out_idx is None else conv.weight[out_idx]
    b = None if conv.bias is None else (conv.bias if out_idx is None else conv.bias[out_idx])
    if in_idx is not None and not depthwise:
        w = w[:, in_idx]
    n_out = w.shape[0]
    n_in = n_out if depthwise else w.shape[1] * conv.groups
    new = nn.Conv2d(n_in, n_out, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                    groups=n_out if depthwise else conv.groups, bias=b is not None)
    with torch.no_grad():
        new.weight.copy_(w)
        if b is not None:
            new.bias.copy_(b)
    return new.to(conv.weight.device)


def _slice_bn(bn: nn.BatchNorm2d, idx: Tensor) -> nn.BatchNorm2d:
    """A copy of ``bn`` keeping channels ``idx`` (affine parameters and running statistics)."""
    new = nn.BatchNorm2d(len(idx), eps=bn.eps, momentum=bn.momentum)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var"):
            getattr(new, name).copy_(getattr(bn, name)[idx])
        new.num_batches_tracked.copy_(bn.num_batches_tracked)
    return new.to(bn.weight.device)


def _top_channels(importance: Tensor, width: float) -> Tensor:
    """Indices of the ``max(1, round(width * n))`` largest entries of ``importance`` (n,), ascending."""
    k = max(1, round(width * importance.numel()))
    return importance.topk(k).indices.sort().values


def narrow_width(subnet: Subnet, width: float) -> Subnet:
    """A copy of ``subnet`` with its hidden channels scaled by ``width`` (elastic width).

    OFA's elastic dimensions (kernel, expand ratio, depth) bound how small a subnet can get: the
    smallest subnet of the quickstart supernet still has 280 k parameters, over half of them in the
    MobileNet-V3 head that every subnet shares (final-expand layer ``C -> F = 960 w``, feature-mix
    layer ``F -> D = 1280 w``, classifier ``D -> n_classes``). Narrowing keeps, in every
    inverted-residual block, ``round(width * mid)`` of its expanded (hidden) channels, and in the
    head ``round(width * F)`` final-expand and ``round(width * D)`` feature-mix channels. The block
    outputs (the residual stream) keep their width, so the result is a valid network for any width.

    Channels are chosen as in OFA's elastic width (Cai et al. 2020, Sec. 3.2, "channel sorting"):
    those with the largest L1 norm of their outgoing weights (the point-wise projection's columns
    for a block's hidden channels, the feature-mix columns for final-expand channels, the
    classifier columns for feature-mix channels), kept in their original order; weights, biases,
    BN parameters and running statistics are copied (SE modules keep their hidden size). The
    choice depends only on ``subnet``'s weights, so every party narrowing the same subnet of the
    same supernet gets the same architecture and state-dict shapes. This cuts RaFL's compact
    knowledge network (:class:`rafl.federation.algorithms.rafl.RaFL`, ``knowledge_width``).

    Args:
        subnet: a :class:`Subnet` (left unchanged).
        width: fraction of hidden channels to keep, in ``(0, 1]`` (1 returns an unchanged copy);
            at least one channel is kept everywhere.

    Returns:
        A new :class:`Subnet`, in ``subnet``'s train/eval mode and on its device, with
        ``feature_dim = round(width * D)``.

    Raises:
        UserInputError: ``width`` outside ``(0, 1]`` (field ``knowledge_width``).
    """
    if isinstance(width, bool) or not 0 < float(width) <= 1:
        raise UserInputError(f"is {width}; allowed: a fraction in (0, 1]", field="knowledge_width")
    out = copy.deepcopy(subnet)
    width = float(width)
    if width == 1:
        return out
    with torch.no_grad():
        for block in out.blocks:
            layer = block.conv
            if getattr(layer, "inverted_bottleneck", None) is None:
                continue  # the first block (expand ratio 1) has no hidden channels of its own
            ib, dw, pl = layer.inverted_bottleneck, layer.depth_conv, layer.point_linear
            keep = _top_channels(pl.conv.weight.abs().sum(dim=(0, 2, 3)), width)
            ib.conv, ib.bn = _slice_conv(ib.conv, out_idx=keep), _slice_bn(ib.bn, keep)
            dw.conv, dw.bn = _slice_conv(dw.conv, out_idx=keep), _slice_bn(dw.bn, keep)
            if getattr(dw, "se", None) is not None:
                fc = dw.se.fc
                fc.reduce = _slice_conv(fc.reduce, in_idx=keep)
                fc.expand = _slice_conv(fc.expand, out_idx=keep)
                dw.se.channel = len(keep)
            pl.conv = _slice_conv(pl.conv, in_idx=keep)
            layer.mid_channels = len(keep)
        fe, fm, head = out.final_expand_layer, out.feature_mix_layer, out.head
        keep_fe = _top_channels(fm.conv.weight.abs().sum(dim=(0, 2, 3)), width)
        keep_fm = _top_channels(head.linear.weight.abs().sum(dim=0), width)
        fe.conv, fe.bn = _slice_conv(fe.conv, out_idx=keep_fe), _slice_bn(fe.bn, keep_fe)
        fe.out_channels = len(keep_fe)
        fm.conv = _slice_conv(fm.conv, out_idx=keep_fm, in_idx=keep_fe)
        fm.in_channels, fm.out_channels = len(keep_fe), len(keep_fm)
        new_head = LinearLayer(len(keep_fm), head.linear.out_features, dropout_rate=OFA_MOBILENET_V3.dropout)
        new_head.linear.weight.copy_(head.linear.weight[:, keep_fm])
        new_head.linear.bias.copy_(head.linear.bias)
        out.head = new_head.to(head.linear.weight.device)
    out.feature_dim = len(keep_fm)
    out.train(subnet.training)
    return out


def subnet_from_arch(space: SearchSpace, arch: ArchConfig) -> Subnet:
    """A freshly initialised :class:`Subnet` of shape ``arch`` (e.g. to load a saved state dict into)."""
    return extract_subnet(build_supernet(space), arch)


def recalibrate_bn(model: nn.Module, loader: Iterable, n_batches: int | None = 20,
                   arch: ArchConfig | None = None, *, device: torch.device | str | None = None,
                   fork_rng: bool = True) -> int:
    """BN recalibration: reset every BatchNorm's running statistics, then re-estimate them.

    The statistics are the exact averages over the first ``n_batches`` batches of ``loader``
    (cumulative moving average, ``momentum=None``), computed in train mode without gradients; the
    model's train/eval mode and BN momenta are restored afterwards. This is OFA's
    ``set_running_statistics`` (Cai et al., "Once-for-All", ICLR 2020, Sec. 3.2), the same pass as
    ``torch.optim.swa_utils.update_bn``.

    Args:
        model: a :class:`Subnet` (or any module: run as ``model(x)``, or as
            ``model.head(model.features(x))`` when it has no ``forward``); a :class:`Supernet`
            recalibrates the slices that subnet ``arch`` (None: largest) uses.
        loader: yields ``(images, labels)`` pairs or image tensors ``(B, 3, H, W)``.
        n_batches: number of batches to use (>= 1); None: all of ``loader``.
        device: where to compute (None: the model's parameters' device).
        fork_rng: leave the global RNG state untouched (forked around the forward passes, whose
            dropout draws from it; ``loader`` is read before the fork, so a shuffling loader's
            draws stay in the caller's stream). False: the passes draw from the caller's stream.

    Returns:
        the number of batches used: 0 when the model has no BatchNorm with running statistics
        (``loader`` is then not read) or ``loader`` is empty (the statistics are then unchanged).

    Raises:
        UserInputError: ``n_batches < 1``.
    """
    if n_batches is not None and n_batches < 1:
        raise UserInputError(f"must be >= 1, got {n_batches}", field="n_batches")
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not bns:
        return 0
    batches: Iterable = iter(loader) if n_batches is None else itertools.islice(iter(loader), n_batches)
    device = torch.device(next(model.parameters()).device if device is None else device)
    if not fork_rng:
        return _bn_statistics_pass(model, bns, batches, arch, device)
    batches = list(batches)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _bn_statistics_pass(model, bns, batches, arch, device)


@torch.no_grad()
def _bn_statistics_pass(model: nn.Module, bns: list[nn.Module], batches: Iterable, arch: ArchConfig | None,
                        device: torch.device) -> int:
    """The forward passes of :func:`recalibrate_bn`; the statistics are reset at the first batch."""
    if isinstance(model, Supernet):
        def forward(x: Tensor) -> Tensor:
            return model(x, arch)
    elif type(model).forward is not nn.Module.forward:
        forward = model
    else:
        def forward(x: Tensor) -> Tensor:
            return model.head(model.features(x))
    was = model.training
    momenta = [m.momentum for m in bns]
    n = 0
    model.train()
    try:
        for batch in batches:
            if n == 0:
                for m in bns:
                    m.reset_running_stats()
                    m.momentum = None  # cumulative average over the pass
            forward((batch[0] if isinstance(batch, list | tuple) else batch).to(device))
            n += 1
    finally:
        for m, momentum in zip(bns, momenta):
            m.momentum = momentum
        model.train(was)
    return n


__all__ = ["Supernet", "Subnet", "build_supernet", "extract_subnet", "narrow_width", "subnet_from_arch",
           "recalibrate_bn", "feature_dim_of", "resize_input", "prepare_input"]
