"""Architecture as data: the search space and one point in it.

``SearchSpace`` describes the once-for-all MobileNet-V3 space (Cai et al., "Once-for-All: Train One
Network and Specialize it for Efficient Deployment", ICLR 2020, Sec. 3.1): 5 elastic stages of up
to 4 inverted-residual blocks each, every block with an elastic kernel size (3/5/7) and expand
ratio (3/4/6), every stage with an elastic depth (2/3/4), plus an elastic input resolution.

``ArchConfig`` is one subnet of that space. It is plain, frozen data: it round-trips to YAML/JSON,
has a short readable string (in the spirit of timm's block strings), validates against a space,
encodes to a fixed-length vector for accuracy predictors, and can be sampled, mutated and crossed
over with an explicit ``numpy.random.Generator`` (OFA's evolutionary operators).

Like OFA, an ``ArchConfig`` stores ``ks``/``e`` for *all* ``n_stages * max_depth`` block slots; the
slots beyond a stage's depth are inactive. :meth:`ArchConfig.canonical` sets them to the smallest
choice so that two archs that build the same network compare (and hash) equal.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from rafl.errors import UserInputError, allowed, brief, shown, yaml_error_detail
from rafl.io import atomic_write_text, load_yaml, read_text_file

#: Bounds of the width multiplier, shared by every place that takes one (``SearchSpace``,
#: ``rafl supernet train``'s TrainConfig, ``rafl profile --width-mult``). Below 0.1 the widths stop
#: following the multiplier: ``make_divisible``'s 8-channel floor takes over (at 0.05 every stage
#: has 8 channels, at 0.001 every layer does); above 2 a supernet is over 4x OFA's full size.
WIDTH_MULT_MIN: float = 0.1
WIDTH_MULT_MAX: float = 2.0
#: Bounds of the classifier's classes (``SearchSpace.n_classes``, ``rafl profile --n-classes``): a
#: classifier needs 2; 100000 covers ImageNet-21k (21841) with room to spare, while its linear head
#: stays <= 1 GB of float32 at the widest width (feature width 2560 at width_mult 2).
N_CLASSES_MIN: int = 2
N_CLASSES_MAX: int = 100_000


@dataclass(frozen=True)
class SearchSpace:
    """The elastic MobileNet-V3 search space and the supernet's fixed macro-architecture.

    Attributes:
        ks_choices: elastic kernel sizes (OFA: 3, 5, 7).
        e_choices: elastic expand ratios of the inverted-residual blocks (OFA: 3, 4, 6).
        d_choices: elastic depths, blocks per stage (OFA: 2, 3, 4).
        resolutions: input resolutions in pixels (square). The default suits 32x32 datasets.
        n_stages: number of elastic stages (OFA: 5).
        width_mult: supernet width multiplier (1.0 = OFA's widths; tests use small values).
        n_classes: number of classes of the classifier.
        stage_strides: stride of the first block of each elastic stage. OFA uses (2, 2, 2, 1, 2)
            with a stride-2 stem for 224 px inputs (total stride 32); for small images the
            supernet keeps these and uses a stride-1 stem, so a 32 px input ends at 2x2.
        stem_stride: stride of the first convolution (OFA: 2; rafl default 1 for 32 px inputs).
    """

    ks_choices: tuple[int, ...] = (3, 5, 7)
    e_choices: tuple[int, ...] = (3, 4, 6)
    d_choices: tuple[int, ...] = (2, 3, 4)
    resolutions: tuple[int, ...] = (24, 28, 32)
    n_stages: int = 5
    width_mult: float = 1.0
    n_classes: int = 10
    stage_strides: tuple[int, ...] = (2, 2, 2, 1, 2)
    stem_stride: int = 1

    def __post_init__(self) -> None:
        for name in ("ks_choices", "e_choices", "d_choices", "resolutions", "stage_strides"):
            value = tuple(sorted(getattr(self, name))) if name != "stage_strides" else tuple(getattr(self, name))
            object.__setattr__(self, name, tuple(int(v) for v in value))
            if not value:
                raise UserInputError("must not be empty", field=f"search_space.{name}")
        if len(self.stage_strides) != self.n_stages:
            raise UserInputError(
                f"has {len(self.stage_strides)} entries, needs n_stages={self.n_stages}",
                field="search_space.stage_strides",
            )
        if any(k % 2 == 0 or k < 1 for k in self.ks_choices):
            raise UserInputError(f"kernel sizes must be odd and positive, got {self.ks_choices}",
                                 field="search_space.ks_choices")
        if not WIDTH_MULT_MIN <= self.width_mult <= WIDTH_MULT_MAX:  # NaN fails too
            raise UserInputError(f"is {self.width_mult}; allowed: a number in {WIDTH_MULT_MIN:g}..{WIDTH_MULT_MAX:g}",
                                 field="search_space.width_mult")
        if not N_CLASSES_MIN <= self.n_classes <= N_CLASSES_MAX:
            raise UserInputError(f"is {self.n_classes}; allowed: an integer in {N_CLASSES_MIN}..{N_CLASSES_MAX}",
                                 field="search_space.n_classes")
        if min(self.d_choices) < 1:
            raise UserInputError("depths must be >= 1", field="search_space.d_choices")
        if min(self.e_choices) < 1:  # e = 0 or -1 trained blocks like k3e-1 without an error
            raise UserInputError(f"expand ratios must be >= 1, got {self.e_choices}", field="search_space.e_choices")

    # ----------------------------------------------------------------- structure
    @property
    def max_depth(self) -> int:
        """Blocks per stage at full depth (OFA: 4)."""
        return max(self.d_choices)

    @property
    def n_blocks(self) -> int:
        """Number of block slots, ``n_stages * max_depth`` (OFA: 20)."""
        return self.n_stages * self.max_depth

    @property
    def encoding_size(self) -> int:
        """Length of :meth:`ArchConfig.encode`: one-hot ks and e per block slot + one-hot r."""
        return self.n_blocks * (len(self.ks_choices) + len(self.e_choices)) + len(self.resolutions)

    def smallest(self) -> ArchConfig:
        """The smallest subnet: min kernel, expand ratio, depth and resolution everywhere."""
        return ArchConfig(
            ks=(min(self.ks_choices),) * self.n_blocks,
            e=(min(self.e_choices),) * self.n_blocks,
            d=(min(self.d_choices),) * self.n_stages,
            r=min(self.resolutions),
        )

    def largest(self) -> ArchConfig:
        """The largest subnet (the full supernet at the largest resolution)."""
        return ArchConfig(
            ks=(max(self.ks_choices),) * self.n_blocks,
            e=(max(self.e_choices),) * self.n_blocks,
            d=(max(self.d_choices),) * self.n_stages,
            r=max(self.resolutions),
        )

    def middle(self) -> ArchConfig:
        """A middle subnet: the median choice of every dimension."""

        def med(values: tuple[int, ...]) -> int:
            return values[len(values) // 2]

        return ArchConfig(
            ks=(med(self.ks_choices),) * self.n_blocks,
            e=(med(self.e_choices),) * self.n_blocks,
            d=(med(self.d_choices),) * self.n_stages,
            r=med(self.resolutions),
        )

    def num_subnets(self) -> int:
        """Number of distinct subnets (distinct networks x resolutions).

        Per stage: sum over depths d of (|ks| * |e|)^d; the stages multiply; times |resolutions|.
        OFA's space at one resolution: (9^2 + 9^3 + 9^4)^5 ~ 2e19.
        """
        per_block = len(self.ks_choices) * len(self.e_choices)
        per_stage = sum(per_block**d for d in self.d_choices)
        return per_stage**self.n_stages * len(self.resolutions)

    def sample(self, rng: np.random.Generator) -> ArchConfig:
        """A uniformly random arch (each choice independently uniform), canonical form."""
        return ArchConfig(
            ks=tuple(int(v) for v in rng.choice(self.ks_choices, self.n_blocks)),
            e=tuple(int(v) for v in rng.choice(self.e_choices, self.n_blocks)),
            d=tuple(int(v) for v in rng.choice(self.d_choices, self.n_stages)),
            r=int(rng.choice(self.resolutions)),
        ).canonical(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON/YAML-safe)."""
        return {
            "ks_choices": list(self.ks_choices),
            "e_choices": list(self.e_choices),
            "d_choices": list(self.d_choices),
            "resolutions": list(self.resolutions),
            "n_stages": self.n_stages,
            "width_mult": self.width_mult,
            "n_classes": self.n_classes,
            "stage_strides": list(self.stage_strides),
            "stem_stride": self.stem_stride,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str | Path | None = None) -> SearchSpace:
        """Inverse of :meth:`to_dict`. Raises UserInputError on unknown keys or bad values: every
        choice list a non-empty list of at most 64 integers in 1..4096, ``n_stages``/``stem_stride``
        integers in 1..64, ``width_mult`` a number, ``n_classes`` an integer (their ranges are
        checked on construction)."""
        if not isinstance(data, dict):
            raise UserInputError(f"is {shown(data)}; allowed: a mapping of the search space's keys", source=source,
                                 field="search_space")
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise UserInputError(f"unknown key(s) {brief(sorted(map(str, unknown)))}; allowed: {sorted(known)}",
                                 source=source, field="search_space")

        def whole(v: Any, lo: int, hi: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        for k, v in data.items():
            if k in ("ks_choices", "e_choices", "d_choices", "resolutions", "stage_strides"):
                if not isinstance(v, list | tuple) or not 1 <= len(v) <= 64 or not all(whole(x, 1, 4096) for x in v):
                    raise UserInputError(f"is {shown(v)}; allowed: a list of 1..64 integers in 1..4096", source=source,
                                         field=f"search_space.{k}")
            elif k in ("n_stages", "stem_stride") and not whole(v, 1, 64):
                raise UserInputError(f"is {shown(v)}; allowed: an integer in 1..64", source=source,
                                     field=f"search_space.{k}")
            elif k == "n_classes" and not whole(v, N_CLASSES_MIN, N_CLASSES_MAX):
                raise UserInputError(f"is {shown(v)}; allowed: an integer in {N_CLASSES_MIN}..{N_CLASSES_MAX}",
                                     source=source, field="search_space.n_classes")
            elif k == "width_mult" and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise UserInputError(f"is {shown(v)}; allowed: a number in {WIDTH_MULT_MIN:g}..{WIDTH_MULT_MAX:g}",
                                     source=source, field="search_space.width_mult")
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except UserInputError as err:
            raise UserInputError(err.message, source=source, field=err.field) from None


@dataclass(frozen=True)
class ArchConfig:
    """One subnet of a :class:`SearchSpace`.

    Attributes:
        ks: kernel size of every block slot, length ``n_stages * max_depth`` (OFA: 20).
        e: expand ratio of every block slot, same length.
        d: depth (active blocks) of every stage, length ``n_stages`` (OFA: 5).
        r: input resolution in pixels (square).
    """

    ks: tuple[int, ...]
    e: tuple[int, ...]
    d: tuple[int, ...]
    r: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "ks", tuple(int(v) for v in self.ks))
        object.__setattr__(self, "e", tuple(int(v) for v in self.e))
        object.__setattr__(self, "d", tuple(int(v) for v in self.d))
        object.__setattr__(self, "r", int(self.r))

    # ----------------------------------------------------------------- validity
    def validate(self, space: SearchSpace, source: str | Path | None = None) -> ArchConfig:
        """Check that this arch belongs to ``space``; return self.

        Raises:
            UserInputError: naming the field (``ks[7]``, ``d``, ``r``...), the value found and the
                allowed values. An arch from another space fails here, never as a shape error.
        """
        if len(self.d) != space.n_stages:
            raise UserInputError(f"has {len(self.d)} stages, the search space has {space.n_stages}",
                                 source=source, field="d")
        for name in ("ks", "e"):
            if len(getattr(self, name)) != space.n_blocks:
                raise UserInputError(
                    f"has {len(getattr(self, name))} block entries, the search space has "
                    f"{space.n_blocks} ({space.n_stages} stages x {space.max_depth} blocks)",
                    source=source, field=name)
        for name, choices in (("ks", space.ks_choices), ("e", space.e_choices), ("d", space.d_choices)):
            for i, v in enumerate(getattr(self, name)):
                if v not in choices:
                    raise UserInputError(f"is {v}, allowed: {allowed(choices)}", source=source,
                                         field=f"{name}[{i}]")
        if self.r not in space.resolutions:
            raise UserInputError(f"is {self.r}, allowed: {allowed(space.resolutions)}", source=source,
                                 field="r")
        return self

    def active_blocks(self, space: SearchSpace) -> list[int]:
        """Indices of the active block slots (the first ``d[s]`` of every stage)."""
        return [s * space.max_depth + j for s in range(space.n_stages) for j in range(self.d[s])]

    def canonical(self, space: SearchSpace) -> ArchConfig:
        """Same network with inactive block slots set to the smallest choices."""
        active = set(self.active_blocks(space))
        ks = tuple(k if i in active else min(space.ks_choices) for i, k in enumerate(self.ks))
        e = tuple(v if i in active else min(space.e_choices) for i, v in enumerate(self.e))
        return replace(self, ks=ks, e=e)

    # ----------------------------------------------------------------- string form
    def to_string(self, space: SearchSpace | None = None) -> str:
        """Short readable form, e.g. ``r32_k3e4.k5e6|k7e3.k3e3|...`` (active blocks, per stage).

        Stages are separated by ``|``, blocks by ``.``; each block is ``k<kernel>e<expand>``.
        """
        max_depth = len(self.ks) // len(self.d) if space is None else space.max_depth
        stages = []
        for s, depth in enumerate(self.d):
            blocks = [f"k{self.ks[s * max_depth + j]}e{self.e[s * max_depth + j]}" for j in range(depth)]
            stages.append(".".join(blocks))
        return f"r{self.r}_" + "|".join(stages)

    def __str__(self) -> str:
        return self.to_string()

    @classmethod
    def from_string(cls, text: str, space: SearchSpace) -> ArchConfig:
        """Parse :meth:`to_string` output. Raises UserInputError on malformed text."""
        try:
            head, body = text.strip().split("_", 1)
            if not head.startswith("r"):
                raise ValueError
            r = int(head[1:])
            stages = body.split("|")
            ks = [min(space.ks_choices)] * space.n_blocks
            e = [min(space.e_choices)] * space.n_blocks
            d = []
            for s, stage in enumerate(stages):
                blocks = stage.split(".")
                d.append(len(blocks))
                for j, blk in enumerate(blocks):
                    k_part, e_part = blk[1:].split("e")
                    if not blk.startswith("k") or s * space.max_depth + j >= space.n_blocks or j >= space.max_depth:
                        raise ValueError
                    ks[s * space.max_depth + j] = int(k_part)
                    e[s * space.max_depth + j] = int(e_part)
        except (ValueError, IndexError):
            raise UserInputError(
                f"cannot parse arch string {text!r}; expected e.g. 'r32_k3e4.k5e6|k7e3.k3e3|...' "
                f"with {space.n_stages} stages of {'/'.join(map(str, sorted(space.d_choices)))} blocks", field="arch") from None
        return cls(ks=tuple(ks), e=tuple(e), d=tuple(d), r=r).validate(space)

    # ----------------------------------------------------------------- files
    def to_dict(self) -> dict[str, Any]:
        """``{"ks": [...], "e": [...], "d": [...], "r": int}`` (JSON/YAML-safe)."""
        return {"ks": list(self.ks), "e": list(self.e), "d": list(self.d), "r": self.r}

    @classmethod
    def from_dict(cls, data: Any, source: str | Path | None = None) -> ArchConfig:
        """Build from a dict with keys ks, e, d, r (an optional ``arch`` wrapper is accepted).

        Raises:
            UserInputError: missing/unknown keys or non-integer values, naming the field.
        """
        if isinstance(data, dict) and "arch" in data and isinstance(data["arch"], dict):
            data = data["arch"]
        if not isinstance(data, dict):
            raise UserInputError("expected a mapping with keys ks, e, d, r", source=source)
        needed = {"ks", "e", "d", "r"}
        missing = needed - set(data)
        if missing:
            raise UserInputError(f"missing key(s) {sorted(missing)}; an arch has ks, e, d, r",
                                 source=source)
        unknown = set(data) - needed
        if unknown:
            raise UserInputError(f"unknown key(s) {sorted(unknown)}; an arch has ks, e, d, r", source=source)
        def is_int(v: Any) -> bool:  # a YAML true/yes is a bool, 32.5 a float: neither is a choice
            return isinstance(v, int) and not isinstance(v, bool)

        for name in ("ks", "e", "d"):
            if isinstance(data[name], list | tuple):
                for i, v in enumerate(data[name]):
                    if not is_int(v):
                        raise UserInputError(f"is {shown(v)}, allowed: an integer", source=source,
                                             field=f"{name}[{i}]")
        if not is_int(data["r"]):
            raise UserInputError(f"is {shown(data['r'])}, allowed: an integer (pixels)", source=source, field="r")
        try:
            return cls(ks=tuple(data["ks"]), e=tuple(data["e"]), d=tuple(data["d"]), r=data["r"])
        except (TypeError, ValueError):
            raise UserInputError("ks, e, d must be lists of integers and r an integer",
                                 source=source) from None

    def save(self, path: str | Path) -> None:
        """Write as YAML (``.yaml``/``.yml``) or JSON (anything else), atomically."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            text = yaml.safe_dump({"arch": self.to_dict(), "string": self.to_string()}, sort_keys=False)
        else:
            text = json.dumps({"arch": self.to_dict(), "string": self.to_string()}, indent=2)
        atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | Path, space: SearchSpace | None = None) -> ArchConfig:
        """Read a YAML/JSON arch file (validated against ``space`` when given).

        Raises:
            UserInputError: unreadable file, malformed content, or an arch outside ``space``.
        """
        path = Path(path)
        if not path.is_file():
            raise UserInputError("no such file (expected a YAML/JSON arch with ks, e, d, r)", source=path)
        try:
            data = load_yaml(read_text_file(path), path)
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise UserInputError(yaml_error_detail(err, "YAML/JSON"), source=path) from None
        arch = cls.from_dict(data, source=path)
        return arch.validate(space, source=path) if space is not None else arch

    # ----------------------------------------------------------------- predictors
    def encode(self, space: SearchSpace) -> np.ndarray:
        """Fixed-length float32 feature vector, shape ``(space.encoding_size,)``.

        Per block slot: one-hot kernel size and one-hot expand ratio, all zeros for inactive slots
        (so depth is encoded by which slots are zero); then one-hot resolution. This is the
        encoding of OFA's accuracy predictor (ofa/nas/accuracy_predictor/arch_encoder.py).
        """
        nk, ne = len(space.ks_choices), len(space.e_choices)
        vec = np.zeros(space.encoding_size, dtype=np.float32)
        for i in self.active_blocks(space):
            base = i * (nk + ne)
            vec[base + space.ks_choices.index(self.ks[i])] = 1.0
            vec[base + nk + space.e_choices.index(self.e[i])] = 1.0
        vec[space.n_blocks * (nk + ne) + space.resolutions.index(self.r)] = 1.0
        return vec

    # ----------------------------------------------------------------- evolution
    def mutate(self, space: SearchSpace, rng: np.random.Generator, prob: float = 0.1,
               resolution_prob: float = 0.5) -> ArchConfig:
        """OFA's mutation: every block's ks and e, and every stage's d, is resampled with
        probability ``prob``; the resolution with probability ``resolution_prob``. Canonical form."""
        ks, e, d = list(self.ks), list(self.e), list(self.d)
        for i in range(space.n_blocks):
            if rng.random() < prob:
                ks[i] = int(rng.choice(space.ks_choices))
            if rng.random() < prob:
                e[i] = int(rng.choice(space.e_choices))
        for s in range(space.n_stages):
            if rng.random() < prob:
                d[s] = int(rng.choice(space.d_choices))
        r = int(rng.choice(space.resolutions)) if rng.random() < resolution_prob else self.r
        return ArchConfig(tuple(ks), tuple(e), tuple(d), r).canonical(space)

    def crossover(self, other: ArchConfig, space: SearchSpace, rng: np.random.Generator) -> ArchConfig:
        """OFA's crossover: every gene (ks[i], e[i], d[s], r) from either parent with p = 1/2."""

        def pick(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
            mask = rng.random(len(a)) < 0.5
            return tuple(int(x if m else y) for x, y, m in zip(a, b, mask))

        r = self.r if rng.random() < 0.5 else other.r
        return ArchConfig(pick(self.ks, other.ks), pick(self.e, other.e), pick(self.d, other.d), r).canonical(space)


def make_divisible(value: float, divisor: int = 8, min_value: int | None = None) -> int:
    """Round a channel count to a multiple of ``divisor`` without going below 90% of it.

    The rule of MobileNet/timm/OFA (``ofa.utils.make_divisible``).
    """
    min_value = divisor if min_value is None else min_value
    new = max(min_value, int(value + divisor / 2) // divisor * divisor)
    if new < 0.9 * value:
        new += divisor
    return int(new)


def log10_num_subnets(space: SearchSpace) -> float:
    """log10 of :meth:`SearchSpace.num_subnets` (handy in reports)."""
    return math.log10(space.num_subnets())


__all__ = ["ArchConfig", "SearchSpace", "make_divisible", "ConvSpec", "StageSpec", "MacroArch",
           "OFA_MOBILENET_V3", "ConvLayout", "BlockLayout", "NetworkLayout", "network_layout"]


# ---------------------------------------------------------------------------- macro-architecture
# The fixed part of the network as data, in the manner of timm's ``_efficientnet_builder``
# (``decode_arch_def`` turns a list of stage specs into block arguments, a builder turns those into
# modules): :data:`OFA_MOBILENET_V3` holds the base widths, activations and SE flags;
# :func:`network_layout` decodes them for one :class:`SearchSpace` (width multiplier, strides,
# depth) into concrete channel counts per layer. ``rafl.supernet.model.Supernet`` builds its modules
# from that layout and ``rafl.search.units`` prices the same layout.


@dataclass(frozen=True)
class ConvSpec:
    """A fixed conv layer (OFA ``ConvLayer``: conv, optional BN, activation; no bias).

    Attributes:
        width: output channels before the width multiplier.
        kernel: kernel size (square).
        act: activation (``relu`` / ``h_swish``).
        use_bn: BatchNorm after the conv.
    """

    width: int
    kernel: int = 1
    act: str = "h_swish"
    use_bn: bool = True


@dataclass(frozen=True)
class StageSpec:
    """A stage of inverted-residual (MBConv) blocks: base width, activation and squeeze-and-excitation.

    ``kernel`` / ``expand_ratio``: fixed choices, or None for elastic ones. The kernel sizes,
    expand ratios and depth of an elastic stage come from the :class:`SearchSpace`, and the stride
    of its first block from ``SearchSpace.stage_strides``.
    """

    width: int
    act: str
    se: bool = False
    kernel: int | None = None
    expand_ratio: int | None = None


@dataclass(frozen=True)
class MacroArch:
    """The fixed macro-architecture of the supernet.

    Attributes:
        stem: the first conv (its stride is ``SearchSpace.stem_stride``).
        first_block: one MBConv block with stride 1 and a fixed kernel and expand ratio.
        stages: the elastic stages, in order.
        final_expand: 1x1 conv after the last stage.
        feature_mix: 1x1 conv after global average pooling (its output is the representation).
        dropout: dropout rate of the classifier (before its linear layer).
        bn_momentum, bn_eps: BatchNorm parameters of every layer.
    """

    stem: ConvSpec
    first_block: StageSpec
    stages: tuple[StageSpec, ...]
    final_expand: ConvSpec
    feature_mix: ConvSpec
    dropout: float
    bn_momentum: float
    bn_eps: float


#: OFA's MobileNet-V3 (Cai et al. 2020; ``ofa/imagenet_classification/elastic_nn/networks/
#: ofa_mbv3.py``: ``base_stage_width = [16, 16, 24, 40, 80, 112, 160, 960, 1280]``, ``act_stages``,
#: ``se_stages``, ``dropout_rate=0.1``, ``bn_param=(0.1, 1e-5)``).
OFA_MOBILENET_V3 = MacroArch(
    stem=ConvSpec(16, kernel=3, act="h_swish"),
    first_block=StageSpec(16, act="relu", se=False, kernel=3, expand_ratio=1),
    stages=(StageSpec(24, "relu"), StageSpec(40, "relu", se=True), StageSpec(80, "h_swish"),
            StageSpec(112, "h_swish", se=True), StageSpec(160, "h_swish", se=True)),
    final_expand=ConvSpec(960, act="h_swish"),
    feature_mix=ConvSpec(1280, act="h_swish", use_bn=False),
    dropout=0.1,
    bn_momentum=0.1,
    bn_eps=1e-5,
)


@dataclass(frozen=True)
class ConvLayout:
    """A decoded fixed conv layer: ``cin -> cout`` channels, ``kernel`` x ``kernel``, ``stride``."""

    cin: int
    cout: int
    kernel: int
    stride: int
    act: str
    use_bn: bool


@dataclass(frozen=True)
class BlockLayout:
    """A decoded MBConv block slot: ``cin -> cout`` channels, stride of its depthwise conv.

    ``kernel`` and ``expand_ratio`` are fixed (the first block's) or None (an elastic slot: chosen
    per subnet by :class:`ArchConfig`).
    """

    cin: int
    cout: int
    stride: int
    act: str
    se: bool
    kernel: int | None = None
    expand_ratio: int | None = None

    @property
    def residual(self) -> bool:
        """Identity shortcut: stride 1 and as many output as input channels."""
        return self.stride == 1 and self.cin == self.cout

    def mid_channels(self, expand_ratio: int) -> int:
        """Expanded (hidden) channels of an elastic slot at ``expand_ratio``: ofa's
        ``DynamicMBConvLayer`` rule ``make_divisible(round(cin * expand_ratio), 8)``."""
        return make_divisible(round(self.cin * expand_ratio), 8)


@dataclass(frozen=True)
class NetworkLayout:
    """The macro-architecture decoded for one search space (see :func:`network_layout`).

    Attributes:
        stem, first_block: the fixed layers before the elastic stages.
        blocks: one :class:`BlockLayout` per block slot, ``n_stages * max_depth`` of them (stage-major;
            slot ``j`` of a stage has the stage's stride when ``j == 0``, else 1).
        final_expand, feature_mix: the fixed layers after the stages (``feature_mix.cout`` is D).
        n_classes: classifier outputs.
        dropout: classifier dropout rate.
    """

    stem: ConvLayout
    first_block: BlockLayout
    blocks: tuple[BlockLayout, ...]
    final_expand: ConvLayout
    feature_mix: ConvLayout
    n_classes: int
    dropout: float

    @property
    def feature_dim(self) -> int:
        """``D``, the width of every subnet's representation (the feature-mix output)."""
        return self.feature_mix.cout


@lru_cache(maxsize=64)
def network_layout(space: SearchSpace, macro: MacroArch = OFA_MOBILENET_V3) -> NetworkLayout:
    """Decode ``macro`` for ``space``: channels ``make_divisible(width * space.width_mult, 8)``, the
    stem stride ``space.stem_stride``, per stage ``space.max_depth`` block slots with the stage's
    stride ``space.stage_strides[s]`` on the first. A space with more stages than ``macro`` repeats
    its last stage spec; one with fewer uses the first ``n_stages``.
    """

    def width(base: int) -> int:
        return make_divisible(base * space.width_mult, 8)

    stem = ConvLayout(3, width(macro.stem.width), macro.stem.kernel, space.stem_stride, macro.stem.act,
                      macro.stem.use_bn)
    fb = macro.first_block
    first = BlockLayout(stem.cout, width(fb.width), stride=1, act=fb.act, se=fb.se, kernel=fb.kernel,
                        expand_ratio=fb.expand_ratio)
    blocks = []
    cin = first.cout
    for s in range(space.n_stages):
        stage = macro.stages[min(s, len(macro.stages) - 1)]
        cout = width(stage.width)
        for j in range(space.max_depth):
            blocks.append(BlockLayout(cin, cout, space.stage_strides[s] if j == 0 else 1, stage.act, stage.se))
            cin = cout
    fe, fm = macro.final_expand, macro.feature_mix
    final_expand = ConvLayout(cin, width(fe.width), fe.kernel, 1, fe.act, fe.use_bn)
    feature_mix = ConvLayout(final_expand.cout, width(fm.width), fm.kernel, 1, fm.act, fm.use_bn)
    return NetworkLayout(stem, first, tuple(blocks), final_expand, feature_mix, space.n_classes, macro.dropout)
