"""The cost model: MACs, parameters, memory, latency and energy of a subnet on a device.

Fast path: per-unit lookup tables built once per (search space, resolution) (OFA's latency lookup
tables generalised to every metric; Cai et al., "Once-for-All", ICLR 2020, Sec. 3.3). Every block
slot's cost depends only on its kernel size and expand ratio, so a query is a sum (a max for peak
memory) of table entries over the active slots: microseconds per arch with :meth:`CostModel.cost`,
and a whole population at once with :meth:`CostModel.batch` (numpy gathers).

Metrics (batch 1, float32 unless said otherwise):

* ``macs_m``: multiply-adds of convolutions and linear layers, millions (FLOPs = 2 x MACs). Bias
  additions, BN, activations, pooling and the SE gating multiply are not counted (fvcore's
  ``conv`` + ``linear`` counts; checked against fvcore on extracted subnets in the tests).
* ``params_m``: trainable parameters, millions (conv/linear weights and biases, BN affine).
* ``peak_memory_mb``: peak live activation memory of inference, MiB, from the torch.fx +
  networkx tensor-lifetime analysis (:func:`rafl.search.memory.fx_peak_memory`) of every unit;
  the caller-owned input stays live for the whole pass. Weights are not included.
* ``train_memory_mb``: training memory at batch B, MiB: weights + gradients + SGD momentum
  (3 x params x 4 bytes) + B x the activations autograd saves per sample (measured per unit with
  ``saved_tensors_hooks``).
* ``latency_ms``: per-unit roofline (profile throughput/bandwidth + per-layer overhead) or the
  profile's measured per-unit LUT (with its ``network_correction``, ``a x sum + b_ms``, when it
  has one: :func:`rafl.search.latency.build_latency_lut`); NaN without a profile.
* ``energy_mj``: MACs x pJ/MAC + DRAM bytes x pJ/byte, or average power x latency; NaN without
  an energy model. Energy per local epoch (a budget) = 3 x energy_mj x epoch_samples
  (backward ~ 2 x forward; Kaplan et al., "Scaling Laws for Neural Language Models", 2020, Sec. 2.1).
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rafl.errors import UserInputError
from rafl.io import atomic_write_text
from rafl.search.latency import latency_lut_correction, load_latency_lut, roofline_latency_ms, unit_energy_mj
from rafl.search.memory import fx_peak_memory, measure_saved_activations
from rafl.search.profile import DeviceProfile, load_profile
from rafl.search.units import UnitSpec, arch_units, build_unit_module, fixed_units, slot_units, unit_input_shape
from rafl.supernet.arch import ArchConfig, SearchSpace
from rafl.supernet.train import TrainConfig

__all__ = ["Cost", "CostModel", "BudgetCheck", "check_budgets", "check_training_memory", "device_memory_bytes",
           "unit_tables", "METRICS"]

METRICS = ("macs_m", "params_m", "peak_memory_mb", "train_memory_mb", "latency_ms", "energy_mj")
MIB = 2**20
BYTES_PER_ELEMENT = 4  # float32
TRAIN_STATE_COPIES = 3  # weights + gradients + SGD momentum
TRAIN_FORWARD_FACTOR = 3.0  # forward + backward ~ 3 x forward (per training sample)


@dataclass(frozen=True)
class Cost:
    """What one subnet costs on one device (see the module docstring for exact definitions).

    Attributes:
        macs_m: conv + linear multiply-adds, millions (batch 1).
        params_m: parameters, millions.
        peak_memory_mb: peak inference activation memory at batch 1, MiB.
        train_memory_mb: training memory at the model's batch size, MiB.
        latency_ms: predicted device latency per image (batch 1), ms (NaN without a profile).
        energy_mj: predicted energy per image, mJ (NaN without an energy model).
    """

    macs_m: float
    params_m: float
    peak_memory_mb: float
    train_memory_mb: float
    latency_ms: float
    energy_mj: float

    @property
    def flops_m(self) -> float:
        """FLOPs in millions (= 2 x MACs)."""
        return 2.0 * self.macs_m

    def to_dict(self) -> dict[str, float]:
        """Plain dict of the six metrics."""
        return asdict(self)


@dataclass(frozen=True)
class BudgetCheck:
    """One budget of a profile checked against a cost.

    Attributes:
        budget: budget name (``latency_ms`` ...).
        value: the subnet's value, in the budget's unit.
        limit: the budget.
        passed: ``value <= limit``.
        margin: ``(limit - value) / limit`` (positive = headroom, negative = overshoot).
    """

    budget: str
    value: float
    limit: float
    passed: bool
    margin: float

    def message(self) -> str:
        """E.g. ``latency_ms: 3.2 > budget 1.5 (over by 113.3%)``."""
        if self.passed:
            return f"{self.budget}: {self.value:.4g} <= budget {self.limit:.4g} ({100 * self.margin:.1f}% headroom)"
        if math.isnan(self.value):
            return f"{self.budget}: cannot be predicted (no model for it in the profile), budget {self.limit:.4g}"
        return f"{self.budget}: {self.value:.4g} > budget {self.limit:.4g} ({self.margin_text()})"

    def margin_text(self) -> str:
        """The margin as printed: ``"+35.0% headroom"``, ``"over by 13.3%"``, or, once the value is
        10x the limit or more, the ratio (``"345x the limit"``; a percentage such as -34411.5% hides
        how far off it is); ``"n/a"`` when the value cannot be predicted."""
        if not math.isfinite(self.margin):
            return "n/a"
        if self.passed:
            return f"{100 * self.margin:.1f}% headroom"
        ratio = self.value / self.limit
        return f"{ratio:.3g}x the limit" if ratio >= 10 else f"over by {-100 * self.margin:.1f}%"


def energy_per_epoch_j(energy_mj: float, profile: DeviceProfile) -> float:
    """Energy of one local epoch, J: ``3 x energy_mj x epoch_samples / 1000``."""
    return TRAIN_FORWARD_FACTOR * energy_mj * profile.epoch_samples / 1000.0


def check_budgets(cost: Cost, profile: DeviceProfile) -> list[BudgetCheck]:
    """Check every budget of ``profile`` (plus ``train_ram_mb`` as the training-memory limit
    when no explicit budget is set). A NaN value (latency/energy not predictable) fails."""
    values = cost.to_dict()
    values["energy_per_epoch_j"] = energy_per_epoch_j(cost.energy_mj, profile)
    checks = []
    for name, limit in profile.effective_budgets():
        v = float(values[name])
        ok = (not math.isnan(v)) and v <= limit
        checks.append(BudgetCheck(name, v, float(limit), ok, (limit - v) / limit if not math.isnan(v) else -math.inf))
    return checks


# --------------------------------------------------------------------------- unit tables
_MEM_CACHE: dict[tuple, tuple[int, int, int]] = {}
_TABLE_CACHE: dict[tuple[SearchSpace, int], dict] = {}
_LOADED_FROM: set[Path] = set()
_LOCK = threading.Lock()


def _disk_cache_path() -> Path:
    root = Path(os.environ.get("RAFL_CACHE_DIR") or Path.home() / ".cache" / "rafl")
    return root / "cost-model" / f"unit-memory-v2-torch{torch.__version__.split('+')[0]}.json"


def _load_disk_cache() -> None:
    """Merge the on-disk unit-memory cache (``$RAFL_CACHE_DIR/cost-model``) into the process cache."""
    path = _disk_cache_path()
    if path in _LOADED_FROM:
        return
    _LOADED_FROM.add(path)
    try:
        data = json.loads(path.read_text())
        for key, value in data.items():
            _MEM_CACHE.setdefault(tuple(json.loads(key)), tuple(int(v) for v in value))
    except (OSError, ValueError, TypeError):
        return  # no cache or a damaged one: rebuild


def _save_disk_cache() -> None:
    try:
        atomic_write_text(_disk_cache_path(), json.dumps({json.dumps(list(k)): list(v) for k, v in _MEM_CACHE.items()}))
    except OSError:
        pass  # read-only cache dir: stay in-process


def unit_memory(spec: UnitSpec) -> tuple[int, int, int, int]:
    """``(peak_free, peak_hold, saved_per_sample, saved_fixed)`` bytes of one unit (cached by memory key).

    peak_free / peak_hold: fx lifetime-analysis peak at batch 1 with the unit's input freed after
    its last use / held for the whole unit. saved_per_sample / saved_fixed: bytes autograd saves
    in train mode per sample / independent of the batch (BN's per-channel batch statistics), from
    the saved bytes at batch 2 and 4. Both run on the meta device (shapes only; identical to a CPU
    run, checked in the tests). Cached per process and on disk.
    """
    key = spec.memory_key
    hit = _MEM_CACHE.get(key)
    if hit is not None:
        return hit
    with torch.device("meta"):  # shapes only: nothing is allocated, initialised or computed
        module = build_unit_module(spec)
        x2, x4 = torch.zeros(unit_input_shape(spec, 2)), torch.zeros(unit_input_shape(spec, 4))
    module.eval()
    trace = fx_peak_memory(module, unit_input_shape(spec), hold_input=False, device="meta")
    module.train()
    s2, s4 = measure_saved_activations(module, x2), measure_saved_activations(module, x4)
    per_sample = (s4 - s2) // 2
    _MEM_CACHE[key] = (trace.peak_bytes_freed, trace.peak_bytes_held, per_sample, s2 - 2 * per_sample)
    return _MEM_CACHE[key]


def unit_tables(space: SearchSpace, r: int) -> dict:
    """Profile-independent per-unit tables of ``space`` at resolution ``r`` (cached per process).

    Returns:
        dict with ``slots`` (``[slot][k][e] -> UnitSpec``), ``head``/``tail`` (named fixed units)
        and arrays of shape ``(n_blocks, n_ks, n_e)``: ``macs``, ``params``, ``saved`` (bytes per
        sample), ``saved_fixed`` (batch-independent saved bytes), ``peak`` (bytes, network input
        included); plus the fixed part's ``fixed_macs``, ``fixed_params``, ``fixed_saved``,
        ``fixed_saved_fixed`` and ``fixed_peak``.
    """
    key = (space, int(r))
    with _LOCK:
        if key in _TABLE_CACHE:
            return _TABLE_CACHE[key]
        _load_disk_cache()
        n_known = len(_MEM_CACHE)
        slots = slot_units(space, r)
        head, tail = fixed_units(space, r)
        shape = (space.n_blocks, len(space.ks_choices), len(space.e_choices))
        macs, params, saved, saved_fixed, peak = (np.zeros(shape) for _ in range(5))
        input_bytes = 3 * r * r * BYTES_PER_ELEMENT
        for i, row in enumerate(slots):
            for k, col in enumerate(row):
                for e, spec in enumerate(col):
                    free, _, sv, sf = unit_memory(spec)
                    macs[i, k, e], params[i, k, e] = spec.macs(), spec.params()
                    saved[i, k, e], saved_fixed[i, k, e], peak[i, k, e] = sv, sf, free + input_bytes
        fixed = head + tail
        mems = [unit_memory(s) for _, s in fixed]
        fixed_peak = max([mems[0][1]] + [m[0] + input_bytes for m in mems[1:]])
        table = {
            "slots": slots, "head": head, "tail": tail, "macs": macs, "params": params,
            "saved": saved, "saved_fixed": saved_fixed, "peak": peak,
            "fixed_macs": float(sum(s.macs() for _, s in fixed)),
            "fixed_params": float(sum(s.params() for _, s in fixed)),
            "fixed_saved": float(sum(m[2] for m in mems)),
            "fixed_saved_fixed": float(sum(m[3] for m in mems)),
            "fixed_peak": float(fixed_peak),
        }
        _TABLE_CACHE[key] = table
        if len(_MEM_CACHE) > n_known:
            _save_disk_cache()
        return table


class CostModel:
    """Cost of subnets of ``space`` on one device, from per-unit lookup tables.

    Args:
        space: the search space (its width multiplier and strides fix every layer's shape).
        profile: a :class:`DeviceProfile`, a shipped profile name or a path; None prices only the
            device-independent metrics (latency and energy are NaN).
        batch_size: training batch size for ``train_memory_mb`` (default: the profile's
            ``batch_size``, else 32).

    Tables are built on construction (about a second per resolution on a laptop core, cached per
    process for the same space). Raises UserInputError for a bad profile or a latency LUT that
    lacks a layer of this space.
    """

    def __init__(self, space: SearchSpace, profile: DeviceProfile | str | Path | None = None,
                 batch_size: int | None = None):
        self.space = space
        self.profile = load_profile(profile) if isinstance(profile, (str, Path)) else profile
        if batch_size is None:
            batch_size = self.profile.batch_size if self.profile is not None else 32
        if int(batch_size) < 1:
            raise UserInputError(f"must be >= 1, got {batch_size}", field="batch_size")
        self.batch_size = int(batch_size)
        self._lut: dict[str, float] | None = None
        self._lut_scale, self._lut_offset_ms = 1.0, 0.0
        if self.profile is not None and self.profile.latency_lut is not None:
            self._lut = load_latency_lut(self.profile.latency_lut_path(), self.profile)
            self._lut_scale, self._lut_offset_ms = latency_lut_correction(self.profile.latency_lut_path())
        self._r_index = {r: i for i, r in enumerate(space.resolutions)}
        self._k_lookup = _lookup(space.ks_choices)
        self._e_lookup = _lookup(space.e_choices)
        self._slot_stage = np.repeat(np.arange(space.n_stages), space.max_depth)
        self._slot_pos = np.tile(np.arange(space.max_depth), space.n_stages)
        # additive metrics (macs, params, saved bytes at batch B, latency, energy) and peak, per resolution
        n_r = len(space.resolutions)
        shape = (n_r, space.n_blocks, len(space.ks_choices), len(space.e_choices))
        self._add = np.zeros(shape + (5,))
        self._peak = np.zeros(shape)
        self._fixed_add = np.zeros((n_r, 5))
        self._fixed_peak = np.zeros(n_r)
        for ri, r in enumerate(space.resolutions):
            t = unit_tables(space, r)
            self._add[ri, ..., 0], self._add[ri, ..., 1] = t["macs"], t["params"]
            self._add[ri, ..., 2] = self.batch_size * t["saved"] + t["saved_fixed"]
            self._peak[ri] = t["peak"]
            for i, row in enumerate(t["slots"]):
                for k, col in enumerate(row):
                    for e, spec in enumerate(col):
                        self._add[ri, i, k, e, 3:] = self._latency_energy(spec)
            fixed = t["head"] + t["tail"]
            lat_en = np.array([self._latency_energy(s) for _, s in fixed]).sum(axis=0)
            if self._lut_offset_ms:  # the LUT's whole-network term (network_correction.b_ms)
                lat_en[0] += self._lut_offset_ms
                if self.profile.energy_pj_per_mac is None and self.profile.avg_power_w is not None:
                    lat_en[1] += self.profile.avg_power_w * self._lut_offset_ms
            self._fixed_add[ri] = [t["fixed_macs"], t["fixed_params"],
                                   self.batch_size * t["fixed_saved"] + t["fixed_saved_fixed"], *lat_en]
            self._fixed_peak[ri] = t["fixed_peak"]
        # flat views for the single-arch fast path
        self._n_e = len(space.e_choices)
        self._n_ke = len(space.ks_choices) * self._n_e
        self._add_flat = self._add.reshape(-1, 5)
        self._peak_flat = self._peak.reshape(-1)
        self._k_map = {k: i for i, k in enumerate(space.ks_choices)}
        self._e_map = {e: i for i, e in enumerate(space.e_choices)}
        self._d_set = set(space.d_choices)

    # ----------------------------------------------------------------- per unit
    def unit_latency_ms(self, spec: UnitSpec) -> float:
        """Predicted latency of one unit (LUT entry, times the LUT's ``network_correction.a`` if it
        has one, or roofline), ms; NaN without a profile.

        Raises:
            UserInputError: the profile's LUT has no entry for this unit configuration.
        """
        if self.profile is None:
            return float("nan")
        if self._lut is not None:
            if spec.key not in self._lut:
                raise UserInputError(
                    f"has no entry for layer {spec.key!r} (built for another search space?); rebuild it "
                    "with `rafl profile --build-lut` for this space", source=self.profile.latency_lut_path(),
                    field="latency_lut")
            return self._lut_scale * self._lut[spec.key]
        return roofline_latency_ms(spec, self.profile)

    def _latency_energy(self, spec: UnitSpec) -> tuple[float, float]:
        lat = self.unit_latency_ms(spec)
        if self.profile is None:
            return lat, float("nan")
        return lat, unit_energy_mj(spec, self.profile, lat)

    def units(self, arch: ArchConfig) -> list[dict]:
        """Per-unit breakdown of ``arch``: name, spec, macs, params, output elements, latency_ms,
        energy_mj, saved bytes per sample and peak bytes (batch 1). For reports."""
        rows = []
        for name, spec in arch_units(self.space, arch):
            free, hold, saved, _ = unit_memory(spec)
            lat, en = self._latency_energy(spec)
            rows.append({"name": name, "spec": spec, "macs": spec.macs(), "params": spec.params(),
                         "out_elements": spec.out_elements(), "latency_ms": lat, "energy_mj": en,
                         "saved_bytes": saved, "peak_bytes": hold if name == "first_conv" else free})
        return rows

    # ----------------------------------------------------------------- queries
    def _indices(self, archs: Sequence[ArchConfig]) -> tuple[np.ndarray, ...]:
        ks = np.asarray([a.ks for a in archs], dtype=np.int64)
        es = np.asarray([a.e for a in archs], dtype=np.int64)
        ds = np.asarray([a.d for a in archs], dtype=np.int64)
        rs = np.asarray([a.r for a in archs], dtype=np.int64)
        space = self.space
        if ks.ndim != 2 or ks.shape[1] != space.n_blocks or es.shape != ks.shape or ds.shape[1:] != (space.n_stages,):
            raise UserInputError(f"archs must have {space.n_blocks} ks/e entries and {space.n_stages} depths",
                                 field="arch")
        try:
            if (ks < 0).any() or (es < 0).any():
                raise IndexError
            k_idx = self._k_lookup[ks]
            e_idx = self._e_lookup[es]
            r_idx = np.asarray([self._r_index[r] for r in rs.tolist()], dtype=np.int64)
        except (IndexError, KeyError):
            raise UserInputError(f"arch outside the search space (ks in {space.ks_choices}, e in "
                                 f"{space.e_choices}, r in {space.resolutions})", field="arch") from None
        if (k_idx < 0).any() or (e_idx < 0).any():
            bad = next(a for a in archs if any(k not in space.ks_choices for k in a.ks)
                       or any(e not in space.e_choices for e in a.e))
            bad.validate(space)
        if not np.isin(ds, space.d_choices).all():
            next(a for a in archs if any(d not in space.d_choices for d in a.d)).validate(space)
        active = self._slot_pos[None, :] < ds[:, self._slot_stage]
        return k_idx, e_idx, r_idx, active

    def batch(self, archs: Sequence[ArchConfig]) -> dict[str, np.ndarray]:
        """Costs of a population, vectorized with numpy.

        Args:
            archs: N archs of this space, or a :class:`rafl.search.genome.Population` (so
                ``cost_fn=cost_model.batch`` works in :func:`rafl.search.evolution.evolve`).

        Returns:
            dict of float64 arrays of shape ``(N,)`` with keys ``macs_m``, ``params_m``,
            ``peak_memory_mb``, ``train_memory_mb``, ``latency_ms``, ``energy_mj``.

        Raises:
            UserInputError: an arch outside the space.
        """
        if hasattr(archs, "archs") and callable(archs.archs):  # a search Population, as evolve's cost_fn gets
            archs = archs.archs()
        if len(archs) == 0:
            return {m: np.zeros(0) for m in METRICS}
        k_idx, e_idx, r_idx, active = self._indices(archs)
        slots = np.arange(self.space.n_blocks)[None, :]
        vals = self._add[r_idx[:, None], slots, k_idx, e_idx]          # (N, n_blocks, 5)
        add = (vals * active[..., None]).sum(axis=1) + self._fixed_add[r_idx]
        peak = np.where(active, self._peak[r_idx[:, None], slots, k_idx, e_idx], 0.0).max(axis=1)
        peak = np.maximum(peak, self._fixed_peak[r_idx])
        params = add[:, 1]
        train = (TRAIN_STATE_COPIES * params * BYTES_PER_ELEMENT + add[:, 2]) / MIB
        return {"macs_m": add[:, 0] / 1e6, "params_m": params / 1e6, "peak_memory_mb": peak / MIB,
                "train_memory_mb": train, "latency_ms": add[:, 3], "energy_mj": add[:, 4]}

    def cost(self, arch: ArchConfig) -> Cost:
        """Cost of one arch: a sum (max for peak memory) of ~20 table entries, ~10-20 us.

        Raises:
            UserInputError: ``arch`` is outside the space.
        """
        space = self.space
        try:
            ri = self._r_index[arch.r]
            if len(arch.d) != space.n_stages or len(arch.ks) != space.n_blocks or len(arch.e) != space.n_blocks:
                raise KeyError
            md = space.max_depth
            idx = [i for s, d in enumerate(arch.d) if d in self._d_set for i in range(s * md, s * md + d)]
            if len(idx) != sum(arch.d):
                raise KeyError
            kmap, emap = self._k_map, self._e_map
            flat = [(ri * space.n_blocks + i) * self._n_ke + kmap[arch.ks[i]] * self._n_e + emap[arch.e[i]] for i in idx]
        except (KeyError, TypeError):
            arch.validate(space)  # raises the precise UserInputError
            raise
        add = self._add_flat[flat].sum(axis=0) + self._fixed_add[ri]
        peak = max(float(self._peak_flat[flat].max()), float(self._fixed_peak[ri]))
        train = (TRAIN_STATE_COPIES * add[1] * BYTES_PER_ELEMENT + add[2]) / MIB
        return Cost(macs_m=float(add[0]) / 1e6, params_m=float(add[1]) / 1e6, peak_memory_mb=peak / MIB,
                    train_memory_mb=float(train), latency_ms=float(add[3]), energy_mj=float(add[4]))

    def violations(self, cost: Cost, profile: DeviceProfile | None = None) -> list[str]:
        """Budgets of ``profile`` (default: this model's) that ``cost`` exceeds, one message each
        naming the budget, the value and the limit; ``[]`` if the subnet fits."""
        profile = profile if profile is not None else self.profile
        if profile is None:
            return []
        return [c.message() for c in check_budgets(cost, profile) if not c.passed]

    def feasible(self, archs: Sequence[ArchConfig], profile: DeviceProfile | None = None) -> np.ndarray:
        """Boolean mask ``(N,)``: which archs meet every budget of ``profile`` (vectorized)."""
        profile = profile if profile is not None else self.profile
        costs = self.batch(archs)
        ok = np.ones(len(archs), dtype=bool)
        if profile is None:
            return ok
        for name, limit in profile.effective_budgets():
            if name == "energy_per_epoch_j":
                values = TRAIN_FORWARD_FACTOR * costs["energy_mj"] * profile.epoch_samples / 1000.0
            else:
                values = costs[name]
            ok &= values <= limit  # NaN compares False: unpredictable = infeasible
        return ok


def _lookup(choices: Sequence[int]) -> np.ndarray:
    table = -np.ones(max(choices) + 1, dtype=np.int64)
    for i, c in enumerate(choices):
        table[c] = i
    return table


# --------------------------------------------------------------------------- supernet training
def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes: the GPU's, or this machine's physical RAM for the CPU
    (None where the platform does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def check_training_memory(config: TrainConfig, n_classes: int, device: torch.device) -> None:
    """Refuse a run whose largest subnet cannot train on ``device`` at the largest of
    ``config.resolutions`` with ``config.batch_size``: rafl's cost model
    (:class:`~rafl.search.cost.CostModel`, ``train_memory_mb``: weights, gradients, SGD momentum
    and the activations kept for the backward pass) gives a lower bound of what one training step
    holds (measured here: 1.7 GiB predicted, 4.0 GiB peak RSS at 128 px), so a run refused here
    would have run out of memory (``--resolutions 1024`` filled 23 GiB of RAM within 25 s).

    Raises:
        UserInputError: naming ``resolutions``, the memory needed and the device's, and the
            largest resolution that fits at this batch size.
    """
    total = device_memory_bytes(device)
    if total is None:
        return
    space = config.space(n_classes)

    def need_mib(r: int) -> float:
        model = CostModel(SearchSpace(**{**space.to_dict(), "resolutions": (r,)}), None, batch_size=config.batch_size)
        big = space.largest()
        return float(model.cost(ArchConfig(ks=big.ks, e=big.e, d=big.d, r=r)).train_memory_mb)

    r_max = max(config.resolutions)
    need = need_mib(r_max)
    if need * 2**20 <= total:
        return
    lo, hi = 4, r_max  # the largest multiple of 4 that fits (memory grows with r^2)
    while hi - lo > 4:
        mid = (lo + hi) // 2 // 4 * 4
        lo, hi = (mid, hi) if need_mib(mid) * 2**20 <= total else (lo, mid)
    gib = 2**30
    raise UserInputError(f"training the largest subnet at {r_max} px with batch_size {config.batch_size} needs at "
                         f"least {need * 2**20 / gib:.1f} GiB ({device.type} memory is {total / gib:.1f} GiB); allowed: "
                         f"resolutions well below {lo} px (where this lower bound alone fills the memory) at this "
                         "batch size, or a smaller batch_size",
                         field="resolutions")
