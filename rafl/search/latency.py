"""Latency and energy of one unit (OFA layer): the roofline model and measured lookup tables.

Roofline (Williams, Waterman, Patterson, "Roofline: an insightful visual performance model",
CACM 52(4), 2009, Eq. 1): an op that does ``W`` MACs and moves ``Q`` bytes takes
``max(W / P, Q / B)`` on a device with sustained throughput ``P`` (MAC/s) and memory bandwidth
``B`` (byte/s). A unit's latency is the sum over its ops plus a fixed per-layer overhead (kernel
launch / framework dispatch).

Measured lookup table (OFA, Cai et al., ICLR 2020, Sec. 3.3, "latency lookup table"): the latency
of every distinct unit configuration, measured on the device itself with
:func:`build_latency_lut` (``rafl profile --build-lut``): fixed thread count, inference mode,
warm-up runs, median of timed repeats. A profile references it with ``latency_lut: <path>``.

Energy (Horowitz, "Computing's energy problem (and what we can do about it)", ISSCC 2014,
Fig. 1.1.9): ``MACs x E_mac + DRAM bytes x E_byte``, or ``avg_power x latency``.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
import yaml
from tqdm import tqdm

from rafl import seeds
from rafl.errors import UserInputError, brief, shown, yaml_error_detail
from rafl.io import atomic_write_yaml, load_yaml, read_text_file
from rafl.search.profile import LUT_FORMAT, DeviceProfile
from rafl.search.units import UnitSpec, arch_units, build_unit_module, unit_input_shape
from rafl.supernet import build_supernet, extract_subnet

__all__ = ["roofline_latency_ms", "unit_energy_mj", "load_latency_lut", "build_latency_lut",
           "measure_latency_ms", "LUT_FORMAT", "CLOCKS", "STATISTICS", "latency_lut_correction",
           "fit_network_correction"]



def roofline_latency_ms(spec: UnitSpec, profile: DeviceProfile, bytes_per_element: int = 4) -> float:
    """Predicted latency of one unit at batch 1, milliseconds.

    ``sum over ops of max(macs / (throughput_gmacs * 1e9), bytes / (mem_bandwidth_gbs * 1e9))``
    plus ``layer_overhead_us``; bytes = input + output activations + weights of the op (float32).
    """
    seconds = 0.0
    for macs, nbytes in spec.op_bytes(bytes_per_element):
        seconds += max(macs / (profile.throughput_gmacs * 1e9), nbytes / (profile.mem_bandwidth_gbs * 1e9))
    return seconds * 1e3 + profile.layer_overhead_us * 1e-3


def unit_energy_mj(spec: UnitSpec, profile: DeviceProfile, latency_ms: float,
                   bytes_per_element: int = 4) -> float:
    """Predicted energy of one unit at batch 1, millijoules (NaN without an energy model).

    With ``energy_pj_per_mac`` and ``energy_pj_per_dram_byte``: ``MACs * E_mac + bytes * E_byte``
    (bytes as in the roofline); otherwise ``avg_power_w * latency``.
    """
    if profile.energy_pj_per_mac is not None and profile.energy_pj_per_dram_byte is not None:
        pj = sum(m * profile.energy_pj_per_mac + b * profile.energy_pj_per_dram_byte
                 for m, b in spec.op_bytes(bytes_per_element))
        return pj * 1e-9
    if profile.avg_power_w is not None:
        return profile.avg_power_w * latency_ms
    return float("nan")


def load_latency_lut(path: str | Path, profile: DeviceProfile | None = None) -> dict[str, float]:
    """Read a latency LUT written by :func:`build_latency_lut`: unit key -> median latency (ms).

    Args:
        profile: the device profile whose ``latency_lut`` names ``path``; an error then names the
            profile file, its ``latency_lut:`` value and the path it resolved to (a relative value
            is taken against the profile's folder, which is easy to get wrong).

    Raises:
        UserInputError: missing file, malformed YAML, wrong format tag or non-positive entries.
    """
    path = Path(path)

    def fail(message: str, field: str | None = None) -> UserInputError:
        if profile is None:
            return UserInputError(message, source=path, field=field)
        where = f"{profile.latency_lut} (resolved to {path.resolve()})" + (f": {field}" if field else "")
        return UserInputError(f"{where}: {message}", source=profile.source, field="latency_lut")

    if not path.is_file():
        what = "no such file" if not path.exists() else "not a file"
        if profile is None:
            raise UserInputError(f"{what}; build a latency LUT with `rafl profile --build-lut`", source=path,
                                 field="latency_lut")
        raise fail(f"{what}; build the LUT with `rafl profile --build-lut --out PATH` "
                   "(a relative latency_lut is taken against the profile's folder)")
    if profile is not None and profile.source is not None and path.resolve() == Path(profile.source).resolve():
        raise fail("is this profile itself, not a latency LUT (a relative latency_lut is taken against the "
                   "profile's folder); build the LUT with `rafl profile --build-lut --out PATH`")
    try:
        data = load_yaml(read_text_file(path), path)
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise fail(yaml_error_detail(err)) from None
    except UserInputError as err:  # a duplicate key, a file over a limit
        if profile is None:
            raise
        raise fail(err.message) from None
    if not isinstance(data, dict) or data.get("format") != LUT_FORMAT or not isinstance(data.get("entries"), dict):
        raise fail(f"not a latency LUT: expected keys format: {LUT_FORMAT!r} and entries: "
                   "{unit key: latency_ms}")
    out = {}
    for key, value in data["entries"].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise fail(f"latency must be a finite number > 0 (ms), got {shown(value)}", field=f"entries.{brief(key)}")
        out[str(key)] = float(value)
    return out


CLOCKS = ("wall", "thread")
STATISTICS = ("median", "min")


def latency_lut_correction(path: str | Path) -> tuple[float, float]:
    """``(a, b_ms)`` of a LUT's ``network_correction`` (whole-network latency = ``a x`` the sum of
    its layers' entries ``+ b_ms``); ``(1.0, 0.0)`` for a LUT without one. Read after
    :func:`load_latency_lut` validated the file."""
    data = load_yaml(Path(path).read_text(), Path(path))
    corr = data.get("network_correction") if isinstance(data, dict) else None
    if not isinstance(corr, dict):
        return 1.0, 0.0
    a, b = corr.get("a"), corr.get("b_ms")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)) or not a > 0:
        raise UserInputError(f"network_correction must have a > 0 and b_ms numbers, got {corr!r}", source=path,
                             field="network_correction")
    return float(a), float(b)


def fit_network_correction(layer_sums, measured) -> tuple[float, float, str]:
    """``(a, b_ms, method)`` minimizing the squared *relative* error of ``a * layer_sum + b``
    against the measured whole-network latencies (least squares; both in ms, one entry per network).

    A network pays what none of its layers pays alone (the module's own forward, the global pool,
    cache misses between layers); nn-Meter (Zhang et al., MobiSys 2021) predicts a model as the sum
    of its kernels' latencies, and this one linear term accounts for the rest.

    The two-term fit needs the subnets' latencies to grow with their layer sums. When the timings
    are too noisy for that (few repeats, a loaded host), its slope comes out ``<= 0``, which would
    predict every subnet at about the same latency or a larger one as faster. Then the one-term
    model ``a * layer_sum`` (``b = 0``, least squares on the same relative error,
    ``a = sum(s/y) / sum((s/y)^2) > 0``) is fitted instead, and ``method`` says so.

    Raises:
        ValueError: no networks, or a layer sum or latency that is not > 0.
    """
    s, y = np.asarray(layer_sums, dtype=float), np.asarray(measured, dtype=float)
    if s.size == 0 or s.shape != y.shape or not (np.all(s > 0) and np.all(y > 0)):
        raise ValueError("fit_network_correction needs as many layer sums as latencies, all > 0")
    design = np.stack([s / y, 1.0 / y], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.ones(len(y)), rcond=None)
    if a > 0:
        return float(a), float(b), ("least squares on the relative error of a x (sum of layer entries) + b_ms "
                                    "against whole random subnets timed the same way")
    r = s / y
    return float(r.sum() / (r * r).sum()), 0.0, (
        f"least squares on the relative error of a x (sum of layer entries), b_ms = 0: the two-term fit "
        f"gave a = {float(a):.4g} <= 0 (timings too noisy to separate a per-network term; time more repeats)")


def _time_round_robin(modules, warmup: int, repeats: int, now, statistic: str, progress: bool, desc: str
                      ) -> list[float]:
    times: list[list[float]] = [[] for _ in modules]
    with torch.inference_mode():
        for rnd in tqdm(range(warmup + repeats), desc=desc, unit="round", disable=not progress):
            for i, (module, x) in enumerate(modules):
                t0 = now()
                module(x)
                if rnd >= warmup:
                    times[i].append((now() - t0) * 1e3)
    pick = statistics.median if statistic == "median" else min
    return [pick(ts) for ts in times]


def measure_latency_ms(module, x, *, warmup: int = 5, repeats: int = 20, clock: str = "wall") -> list[float]:
    """Time ``module(x)`` in inference mode: ``warmup`` untimed runs, then ``repeats`` timed runs.

    Args:
        clock: ``"wall"`` (``time.perf_counter``: latency on a quiet machine) or ``"thread"``
            (``time.thread_time``: CPU time of the calling thread; with one torch thread it equals
            the latency without the time other processes take while this one is preempted, i.e.
            a robust measurement on a shared, loaded host).

    Returns:
        the ``repeats`` latencies in milliseconds (take the median / p90).
    """
    if clock not in CLOCKS:
        raise UserInputError(f"is {clock!r}, allowed: {', '.join(CLOCKS)}", field="clock")
    now = time.perf_counter if clock == "wall" else time.thread_time
    module.eval()
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            module(x)
        for _ in range(repeats):
            t0 = now()
            module(x)
            times.append((now() - t0) * 1e3)
    return times


def build_latency_lut(specs: Iterable[UnitSpec], out: str | Path, *, threads: int = 1, warmup: int = 5,
                      repeats: int = 15, progress: bool = True, meta: dict | None = None,
                      clock: str = "wall", statistic: str = "median", space=None, calibrate: int = 0,
                      seed: int = 0) -> dict[str, float]:
    """Measure every distinct unit configuration on this machine and write the LUT (YAML, atomic).

    Layers are timed round-robin (each round runs every layer once) so that caches are in the state
    a layer meets inside a network, not warmed by its own previous run.

    Args:
        specs: unit configurations (duplicates are measured once).
        out: output YAML path.
        threads: ``torch.set_num_threads`` during the measurement (restored afterwards).
        warmup, repeats: untimed warm-up runs and timed repeats per configuration.
        progress: show a tqdm bar.
        meta: extra fields recorded in the file (e.g. the search space).
        clock: ``"wall"`` or ``"thread"`` (see :func:`measure_latency_ms`).
        statistic: ``"median"`` (a quiet device) or ``"min"`` (the run least disturbed by other
            processes: a shared, loaded host) of the timed runs.
        space, calibrate: with a :class:`SearchSpace` and ``calibrate > 0``, also time
            ``calibrate`` random whole subnets of ``space`` (random weights; latency does not depend
            on them) the same way and store ``network_correction: {a, b_ms}``
            (:func:`fit_network_correction`), which :class:`rafl.search.cost.CostModel` applies.
        seed: the random subnets and weights.

    Returns:
        unit key -> latency (ms), batch 1.
    Raises:
        UserInputError: an unknown ``clock`` or ``statistic``.
    """
    if clock not in CLOCKS:
        raise UserInputError(f"is {clock!r}, allowed: {', '.join(CLOCKS)}", field="clock")
    if statistic not in STATISTICS:
        raise UserInputError(f"is {statistic!r}, allowed: {', '.join(STATISTICS)}", field="statistic")
    now = time.perf_counter if clock == "wall" else time.thread_time
    unique: dict[str, UnitSpec] = {}
    for s in specs:
        unique.setdefault(s.key, s)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    correction = None
    try:
        torch.manual_seed(seeds.int_seed("latency-layers", seed))
        built = [(build_unit_module(spec).eval(), torch.randn(unit_input_shape(spec)))
                 for spec in tqdm(unique.values(), desc="build layers", unit="layer", disable=not progress)]
        # Round-robin: every round runs each layer once, so between two runs of a layer the others
        # have run (as inside a network, where a layer's weights are not hot in cache); a layer timed
        # back-to-back would look faster than it is in a network.
        lat = _time_round_robin(built, warmup, repeats, now, statistic, progress, "latency LUT")
        entries = {key: round(v, 6) for key, v in zip(unique, lat)}
        if space is not None and calibrate > 0:
            rng = seeds.generator("latency-archs", seed)
            archs = [space.sample(rng) for _ in range(calibrate)]
            supernet = build_supernet(space).eval()
            nets = [(extract_subnet(supernet, a).eval(), torch.randn(1, 3, a.r, a.r)) for a in archs]
            whole = _time_round_robin(nets, warmup, repeats, now, statistic, progress, "whole subnets")
            sums = [sum(entries[s.key] for _, s in arch_units(space, a)) for a in archs]
            a, b, method = fit_network_correction(sums, whole)
            correction = {"a": round(a, 6), "b_ms": round(b, 6), "n_subnets": calibrate, "method": method}
    finally:
        torch.set_num_threads(old_threads)
    doc = {
        "format": LUT_FORMAT,
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                 "system": platform.system(), "cpu_count": os.cpu_count(), "torch": str(torch.__version__)},
        "threads": threads, "warmup": warmup, "repeats": repeats, "statistic": statistic, "batch_size": 1,
        "schedule": "round-robin",
        "clock": clock,
        "unit": "ms",
        **(meta or {}),
        **({"network_correction": correction} if correction else {}),
        "entries": entries,
    }
    atomic_write_yaml(out, doc)
    return entries
