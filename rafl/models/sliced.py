"""Width-sliced model families for HeteroFL / FedRolex: one architecture at several width rates.

HeteroFL (Diao et al., "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021, Sec. 3) gives a client of width rate ``r`` the model whose every
hidden layer keeps ``ceil(r * C)`` of the global model's ``C`` channels, so its weights are the
leading slice of the global ones; the paper's rates are 1, 1/2, 1/4, 1/8 (levels a-d). Members are
named ``<base>@<rate>``:

* ``cnn4@r``: the HtFE group's 4-layer CNN (the FedAvg CNN: two 5x5 convs of 32 and 64 channels
  with 2x2 max-pooling, a 512-unit hidden layer) with BatchNorm after each conv, and global average
  pooling instead of a 4x4 pool + flatten, so the hidden layer's input is the channel dimension
  itself (a rolling window over it stays one window);
* ``resnet18@r``: ResNet-18 for small images (3x3 stride-1 stem, no max-pool; He et al. 2016's
  CIFAR layout), stage widths 64, 128, 256, 512.

Both end like :class:`rafl.models.zoo.HeteroModel`: ``features(x) -> (B, ceil(r * D))`` (a
projection ``Linear + ReLU`` to the representation width ``D``, sliced too) and ``head =
Linear(ceil(r * D), K)``. Every conv / linear hidden layer is followed by a :class:`Scaler` (the
paper's Sec. 3.2: outputs divided by ``r`` in training so that a narrow model's activations match
the wide one's; identity at inference); the algorithm switches it on or off.

Groups: ``heterofl-cnn4`` = cnn4@1, cnn4@0.5, cnn4@0.25, cnn4@0.125; ``heterofl-resnet18`` likewise.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rafl.errors import UserInputError

#: HeteroFL's width rates (levels a-d).
RATES = (1.0, 0.5, 0.25, 0.125)
BASES = ("cnn4", "resnet18")
GROUPS = {f"heterofl-{b}": tuple(f"{b}@{r:g}" for r in RATES) for b in BASES}


class Scaler(nn.Module):
    """HeteroFL's scaler (Diao et al. 2021, Sec. 3.2): ``x / rate`` in training mode while
    ``enabled``, ``x`` otherwise. Shapes unchanged."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = float(rate)
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.rate if (self.training and self.enabled) else x


def width(c: int, rate: float) -> int:
    """``ceil(rate * c)``, at least 1 (HeteroFL's channel count at a rate)."""
    return max(1, int(math.ceil(rate * c - 1e-9)))


def _conv_bn(c_in: int, c_out: int, k: int, rate: float, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, stride, k // 2, bias=False), Scaler(rate), nn.BatchNorm2d(c_out)]


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, rate: float):
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(c_in, c_out, 3, rate, stride), nn.ReLU(inplace=True),
                                  *_conv_bn(c_out, c_out, 3, rate))
        self.shortcut = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), Scaler(rate), nn.BatchNorm2d(c_out))
                         if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class SlicedNet(nn.Module):
    """``<base>@<rate>`` (module docstring). ``features``: ``(B, C, H, W)`` with C in {1, 3} ->
    ``(B, ceil(rate * D))``; ``head``: ``(B, ceil(rate * D)) -> (B, K)``; ``forward = head o features``.

    Raises:
        UserInputError: an unknown base or a rate outside (0, 1] (field ``clients.models``).
    """

    def __init__(self, base: str, rate: float, n_classes: int, feature_dim: int):
        super().__init__()
        if base not in BASES:
            raise UserInputError(f"unknown width-sliced model {base!r}; allowed: {', '.join(BASES)}", field="clients.models")
        if not 0 < rate <= 1:
            raise UserInputError(f"{base}@{rate:g}: the width rate must be in (0, 1]", field="clients.models")
        self.name, self.rate = f"{base}@{rate:g}", float(rate)
        if base == "cnn4":
            c1, c2, hidden = width(32, rate), width(64, rate), width(512, rate)
            self.backbone = nn.Sequential(*_conv_bn(3, c1, 5, rate), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                          *_conv_bn(c1, c2, 5, rate), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                          nn.Linear(c2, hidden), Scaler(rate), nn.ReLU(inplace=True))
            out = hidden
        else:
            widths = [width(c, rate) for c in (64, 128, 256, 512)]
            layers: list[nn.Module] = [*_conv_bn(3, widths[0], 3, rate), nn.ReLU(inplace=True)]
            c_in = widths[0]
            for i, c in enumerate(widths):
                layers += [_Block(c_in, c, 1 if i == 0 else 2, rate), _Block(c, c, 1, rate)]
                c_in = c
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
            self.backbone = nn.Sequential(*layers)
            out = c_in
        self.feature_dim = width(int(feature_dim), rate)
        self.proj = nn.Sequential(nn.Linear(out, self.feature_dim), Scaler(rate), nn.ReLU(inplace=False))
        self.head = nn.Linear(self.feature_dim, n_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.proj(self.backbone(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return f"name={self.name}, feature_dim={self.feature_dim}"


def parse_sliced(name: str) -> tuple[str, float] | None:
    """``"cnn4@0.5"`` -> ``("cnn4", 0.5)``; None for names that are not ``<base>@<rate>``.

    Raises:
        UserInputError: ``<base>@<rate>`` with an unknown base or a rate that is not a number in (0, 1].
    """
    if "@" not in name or ":" in name:
        return None
    base, _, rate = name.partition("@")
    try:
        r = float(rate)
    except ValueError:
        r = float("nan")
    if base not in BASES or not 0 < r <= 1:
        raise UserInputError(f"{name!r}: width-sliced models are <base>@<rate> with base one of {', '.join(BASES)} "
                             "and rate in (0, 1] (e.g. cnn4@0.25)", field="clients.models")
    return base, r


def set_scalers(model: nn.Module, enabled: bool) -> None:
    """Switch every :class:`Scaler` of ``model`` on or off."""
    for m in model.modules():
        if isinstance(m, Scaler):
            m.enabled = bool(enabled)


__all__ = ["BASES", "GROUPS", "RATES", "Scaler", "SlicedNet", "parse_sliced", "set_scalers", "width"]
