"""Benchmark of the cost model (issue 4, "Measured").

1. Query speed: ``CostModel.cost`` / ``CostModel.batch`` vs fvcore ``FlopCountAnalysis`` on extracted
   subnets of the same archs (target: >= 1000x faster), and their MACs agreement.
2. Latency: predicted (per-layer LUT measured on this host with ``build_latency_lut``; and the pi4
   roofline, rank only) vs measured whole-subnet latency on this host over 30 random archs:
   Spearman rank correlation and median relative error.

Run: ``python bench/cost_model.py [--width-mult 0.5] [--fvcore-archs 20] [--latency-archs 30]``.
Writes ``bench/results/cost_model.txt`` and ``cost_model.json`` (latest output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width-mult", type=float, default=0.5)
    ap.add_argument("--fvcore-archs", type=int, default=20)
    ap.add_argument("--query-archs", type=int, default=2000)
    ap.add_argument("--latency-archs", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "thread"), default="thread",
                    help="thread CPU time (robust on a shared, loaded host; default) or wall clock")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)

    from fvcore.nn import FlopCountAnalysis
    from scipy.stats import spearmanr
    from tqdm import tqdm

    from rafl.search.cost import CostModel
    from rafl.search.latency import build_latency_lut
    from rafl.search.profile import DeviceProfile, load_profile
    from rafl.search.units import fixed_units, slot_units
    from rafl.supernet import build_supernet, extract_subnet
    from rafl.supernet.arch import SearchSpace

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    space = SearchSpace(width_mult=args.width_mult)
    rng = np.random.default_rng(args.seed)
    lines = [f"# cost model benchmark: width x{space.width_mult}, resolutions {space.resolutions}, "
             f"1 torch thread, {args.clock} clock, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (shared machine: timings are noisy)"]

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as cache:  # a cold on-disk cache: time the real table build
        os.environ["RAFL_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        model = CostModel(space, load_profile("pi4"))
        say(f"table build (cold cache, {len(space.resolutions)} resolutions): {time.perf_counter() - t0:.2f} s")

    # ---- 1. query speed vs fvcore, and agreement
    supernet = build_supernet(space).eval()
    archs = [space.sample(rng) for _ in range(args.fvcore_archs)]
    fv_time, fv_macs = 0.0, []
    for arch in tqdm(archs, desc="fvcore", unit="arch"):
        sub = extract_subnet(supernet, arch).eval()  # extraction not timed
        x = torch.zeros(1, 3, arch.r, arch.r)
        t = time.perf_counter()
        counts = FlopCountAnalysis(sub, x).unsupported_ops_warnings(False).uncalled_modules_warnings(False).by_operator()
        fv_time += time.perf_counter() - t
        fv_macs.append((counts.get("conv", 0) + counts.get("linear", 0)) / 1e6)
    lut_macs = [model.cost(a).macs_m for a in archs]
    many = [space.sample(rng) for _ in range(args.query_archs)]
    t = time.perf_counter()
    for a in many:
        model.cost(a)
    single = (time.perf_counter() - t) / len(many)
    t = time.perf_counter()
    model.batch(many)
    batched = (time.perf_counter() - t) / len(many)
    fv_per = fv_time / len(archs)
    rel = np.abs(np.array(lut_macs) - np.array(fv_macs)) / np.array(fv_macs)
    say(f"fvcore FlopCountAnalysis: {fv_per * 1e3:.1f} ms/arch ({1 / fv_per:.1f} queries/s) over {len(archs)} archs")
    say(f"CostModel.cost:  {single * 1e6:.1f} us/arch ({1 / single:,.0f} queries/s, {len(many)} archs) -> "
        f"{fv_per / single:,.0f}x fvcore")
    say(f"CostModel.batch: {batched * 1e6:.2f} us/arch ({1 / batched:,.0f} queries/s, population of "
        f"{len(many)}) -> {fv_per / batched:,.0f}x fvcore")
    say(f"MACs agreement (conv + linear): max relative difference {rel.max():.2e} over {len(archs)} archs")

    # ---- 2. predicted vs measured host latency
    specs = []
    for r in space.resolutions:
        head, tail = fixed_units(space, r)
        specs += [s for _, s in head + tail] + [s for row in slot_units(space, r) for col in row for s in col]
    with tempfile.TemporaryDirectory() as tmp:
        lut_path = Path(tmp) / "host-lut.yaml"
        t = time.perf_counter()
        entries = build_latency_lut(specs, lut_path, threads=1, warmup=3, repeats=args.repeats, progress=True,
                                    clock=args.clock)
        say(f"host LUT: {len(entries)} layer configurations measured in {time.perf_counter() - t:.1f} s")
        host = DeviceProfile.from_dict({"name": "host", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                        "latency_lut": str(lut_path)})
        host_model = CostModel(space, host)
        lat_archs = [space.smallest(), space.largest()] + [space.sample(rng) for _ in range(args.latency_archs - 2)]
        pred = host_model.batch(lat_archs)["latency_ms"]
    roof = model.batch(lat_archs)["latency_ms"]
    macs = model.batch(lat_archs)["macs_m"]
    # whole subnets timed round-robin like the LUT (one run of each subnet per round), so that load
    # fluctuations of the shared host spread over all archs instead of hitting a few
    subs = [(extract_subnet(supernet, a).eval(), torch.randn(1, 3, a.r, a.r)) for a in lat_archs]
    now = time.thread_time if args.clock == "thread" else time.perf_counter
    samples: list[list[float]] = [[] for _ in subs]
    with torch.inference_mode():
        for rnd in tqdm(range(3 + args.repeats), desc="measure", unit="round"):
            for i, (sub, x) in enumerate(subs):
                t = now()
                sub(x)
                if rnd >= 3:
                    samples[i].append((now() - t) * 1e3)
    measured = np.array([statistics.median(s) for s in samples])
    err = np.abs(pred - measured) / measured
    rho_lut = spearmanr(pred, measured).statistic
    rho_roof = spearmanr(roof, measured).statistic
    rho_macs = spearmanr(macs, measured).statistic
    say(f"predicted (host LUT) vs measured latency over {len(lat_archs)} archs: Spearman {rho_lut:.3f}, "
        f"median relative error {np.median(err) * 100:.1f}% (measured {measured.min():.2f}-{measured.max():.2f} ms)")
    say(f"rank correlation with measured host latency of the pi4 roofline: {rho_roof:.3f}; of MACs alone: {rho_macs:.3f}")
    result = {"fvcore_ms_per_arch": fv_per * 1e3, "cost_us_per_arch": single * 1e6, "batch_us_per_arch": batched * 1e6,
              "speedup_single": fv_per / single, "speedup_batch": fv_per / batched, "macs_max_rel_diff": float(rel.max()),
              "latency_spearman_lut": float(rho_lut), "latency_median_rel_err_lut": float(np.median(err)),
              "latency_spearman_roofline_pi4": float(rho_roof), "latency_spearman_macs": float(rho_macs),
              "n_latency_archs": len(lat_archs), "n_fvcore_archs": len(archs), "width_mult": space.width_mult}
    if not args.no_save:
        from rafl.io import atomic_write_json, atomic_write_text

        atomic_write_text(RESULTS / "cost_model.txt", "\n".join(lines) + "\n")
        atomic_write_json(RESULTS / "cost_model.json", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
