"""Classic heterogeneous model groups (FedTGP's "HtFE" groups) with a common representation width.

FedTGP (Zhang et al., AAAI 2024, Sec. "Experimental Setup") federates groups of unrelated
architectures, e.g. HtFE8 = {4-layer CNN, GoogLeNet, MobileNetV2, ResNet-18/34/50/101/152}. Here
every member is a :class:`HeteroModel`: a backbone (torchvision's model with its classifier
removed, ``weights=None`` -- nothing downloads --, adapted to small images by
:func:`small_image_variant`, or a small CNN), a projection ``Linear(C, D) +
ReLU`` to the common width ``D`` (the representation ``features(x) -> (B, D)`` of FedGH / FedProto
/ FedTGP) and the header ``head = Linear(D, K)``. Members work on 32x32 inputs and on 1-channel images
(repeated to 3 channels).

Groups (assigned to clients round-robin, client ``i`` gets ``group[i % len(group)]``):

=============  ==================================================================================
``htfe4``      cnn4, resnet18, mobilenet_v2, shufflenet_v2
``htfe8``      cnn4, googlenet, mobilenet_v2, resnet18, resnet34, resnet50, resnet101, resnet152
``htfe-tiny``  cnn4-small, cnn3-small, mobilenet_v2-0.25, shufflenet_v2-0.5 (CPU-friendly, for
               tests and benches)
=============  ==================================================================================
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rafl.errors import UserInputError, allowed

#: Default representation width D of the model groups.
DEFAULT_FEATURE_DIM = 128


class HeteroModel(nn.Module):
    """A heterogeneous client model: ``backbone -> Linear(C, D) -> ReLU`` = ``features``, ``head``.

    Args:
        name: the member's name (e.g. ``"resnet18"``).
        backbone: maps ``(B, 3, H, W)`` to ``(B, C)`` (pooled, flat).
        backbone_dim: C.
        n_classes: K.
        feature_dim: D.

    ``features(x)``: ``(B, C_in, H, W)`` with ``C_in`` 1 or 3 -> ``(B, D)``; ``head``: ``Linear(D, K)``;
    ``forward(x) = head(features(x))`` -> ``(B, K)`` logits.
    """

    def __init__(self, name: str, backbone: nn.Module, backbone_dim: int, n_classes: int, feature_dim: int):
        super().__init__()
        self.name = name
        self.feature_dim = int(feature_dim)
        self.backbone = backbone
        self.proj = nn.Sequential(nn.Linear(backbone_dim, feature_dim), nn.ReLU(inplace=False))
        self.head = nn.Linear(feature_dim, n_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.proj(torch.flatten(self.backbone(x), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return f"name={self.name}, feature_dim={self.feature_dim}"


class SmallCNN(nn.Module):
    """The FedAvg CNN (McMahan et al. 2017; HtFLlib's ``FedAvgCNN``) without its classifier:
    ``n_conv`` x (conv 5x5 (3x3 after the second) + ReLU + max-pool 2) then ``Linear -> hidden`` + ReLU.
    With the projection and the header of :class:`HeteroModel`, ``n_conv=2`` is the "4-layer CNN".
    Input ``(B, 3, H, W)`` with H, W >= 4 * 2**(n_conv-1); output ``(B, hidden)``."""

    def __init__(self, channels: tuple[int, ...] = (32, 64), hidden: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for i, c in enumerate(channels):
            k = 5 if i < 2 else 3
            layers += [nn.Conv2d(c_in, c, k, padding=k // 2), nn.ReLU(inplace=True), nn.MaxPool2d(2)]
            c_in = c
        self.conv = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Sequential(nn.Linear(c_in * 16, hidden), nn.ReLU(inplace=True))
        self.out_dim = hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.conv(x)), 1))


def small_image_variant(model: nn.Module) -> nn.Module:
    """Adapt a torchvision ImageNet network to 32x32 inputs by removing the first 4x of
    downsampling (as the usual CIFAR variants do): ResNet: 3x3 stride-1 stem and no max-pool
    (He et al. 2016, Sec. 4.2's CIFAR networks keep full resolution in the first stage);
    GoogLeNet / ShuffleNetV2: no first max-pool, stride-1 stem for GoogLeNet; MobileNetV2:
    stride-1 first conv and second stage. The last feature map is then 4x4 (ResNet), 2x2
    (others) instead of 1x1, so BatchNorm's statistics are estimated over more than one value per
    sample and eval-mode (running-statistics) representations stay close to training ones."""
    name = type(model).__name__
    if name == "ResNet":
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
        model.maxpool = nn.Identity()
    elif name == "GoogLeNet":
        model.conv1.conv.stride = (1, 1)
        model.maxpool1 = nn.Identity()
    elif name == "ShuffleNetV2":
        model.maxpool = nn.Identity()
    elif name == "MobileNetV2":
        model.features[0][0].stride = (1, 1)
    return model


def _torchvision(builder: str, **kwargs) -> Callable[[], tuple[nn.Module, int]]:
    def make() -> tuple[nn.Module, int]:
        import torchvision.models as tvm  # noqa: PLC0415 - seconds more than torch; only for a torchvision model

        model = small_image_variant(getattr(tvm, builder)(weights=None, **kwargs))
        if hasattr(model, "fc") and isinstance(model.fc, nn.Linear):        # resnet, googlenet, shufflenet
            dim = model.fc.in_features
            model.fc = nn.Identity()
        else:                                                                 # mobilenet_v2
            dim = model.classifier[-1].in_features
            model.classifier = nn.Identity()
        return model, dim
    return make


def _cnn(channels: tuple[int, ...], hidden: int) -> Callable[[], tuple[nn.Module, int]]:
    def make() -> tuple[nn.Module, int]:
        net = SmallCNN(channels, hidden)
        return net, net.out_dim
    return make


#: name -> builder of ``(backbone, C)``.
BACKBONES: dict[str, Callable[[], tuple[nn.Module, int]]] = {
    "cnn4": _cnn((32, 64), 512),
    "cnn4-small": _cnn((16, 32), 128),
    "cnn3-small": _cnn((16, 32, 48), 128),
    "resnet18": _torchvision("resnet18"),
    "resnet34": _torchvision("resnet34"),
    "resnet50": _torchvision("resnet50"),
    "resnet101": _torchvision("resnet101"),
    "resnet152": _torchvision("resnet152"),
    "googlenet": _torchvision("googlenet", aux_logits=False, init_weights=True, transform_input=False),
    "mobilenet_v2": _torchvision("mobilenet_v2"),
    "mobilenet_v2-0.25": _torchvision("mobilenet_v2", width_mult=0.25),
    "shufflenet_v2": _torchvision("shufflenet_v2_x1_0"),
    "shufflenet_v2-0.5": _torchvision("shufflenet_v2_x0_5"),
}

#: Named heterogeneous groups (FedTGP's HtFE groups and a small one for CPUs).
GROUPS: dict[str, tuple[str, ...]] = {
    "htfe4": ("cnn4", "resnet18", "mobilenet_v2", "shufflenet_v2"),
    "htfe8": ("cnn4", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"),
    "htfe-tiny": ("cnn4-small", "cnn3-small", "mobilenet_v2-0.25", "shufflenet_v2-0.5"),
}

#: The shared model (FML's meme model, FedKD's mentee, RaFL's knowledge network) of a group.
KNOWLEDGE_MODEL = "cnn4-small"


def build_model(name: str, n_classes: int, feature_dim: int = DEFAULT_FEATURE_DIM) -> HeteroModel:
    """A fresh :class:`HeteroModel` ``name`` (random init from torch's global RNG).

    Raises:
        UserInputError: unknown name (field ``--models``), listing the known ones.
    """
    if name not in BACKBONES:
        raise UserInputError(f"unknown model {name!r}; {allowed(sorted(BACKBONES))}, a group "
                             f"({', '.join(GROUPS)}) or package.module:factory", field="--models")
    backbone, dim = BACKBONES[name]()
    return HeteroModel(name, backbone, dim, n_classes, feature_dim)


__all__ = ["HeteroModel", "SmallCNN", "BACKBONES", "GROUPS", "KNOWLEDGE_MODEL", "DEFAULT_FEATURE_DIM",
           "build_model"]
