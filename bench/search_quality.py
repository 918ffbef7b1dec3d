"""Search quality: does rafl's search find good subnets, fast, under budgets that bind?

For every shipped profile (pi4, jetson-nano, phone, server-gpu) on one supernet:

1. The predictor, trained the once-for-all way (Cai et al., ICLR 2020, Sec. 3.4): ``--predictor-samples``
   subnets sampled across the space, measured on the server-val split (cached per supernet);
   cross-validated Kendall tau and RMSE.
2. rafl's pick (``search_subnets``, default config: population 100 x 500 generations, top-5
   re-measured, shared finalists) vs (a) the best *measured* of ``--random`` random subnets that meet
   the same budgets and (b) ofa's ``EvolutionFinder`` with the same predictor, the same budgets (as
   one constraint: the largest cost / budget ratio <= 1) and the same population / generations; its
   best arch measured the same way. Speed: ofa's finder vs rafl's ``evolve`` on that same work.
3. Latency the way nn-Meter reports it (Zhang et al., MobiSys 2021, Sec. 6: the share of models
   predicted within +-10% of the measured latency): a per-layer LUT measured on this host
   (``build_latency_lut``, the thread clock) against whole-subnet latency measured on this host,
   over ``--latency-archs`` random subnets; plus the roofline with parameters fit to this host's LUT,
   the error to expect of a device profile's roofline (whose parameters come from datasheets).
4. ``search_quality_pareto.png``: every profile's pick (predicted and measured accuracy) against its
   predicted device latency, each profile's latency budget a line.

Run (the shipped CIFAR-10 supernet): ``python bench/search_quality.py --supernet runs/cifar10-supernet``.
Writes bench/results/search_quality.{md,json} and search_quality_pareto.png (``--tag`` adds a suffix).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rafl.io import atomic_write_json, atomic_write_text
from rafl.search.cost import CostModel, energy_per_epoch_j
from rafl.search.estimators import (
    MeasuredAccuracy,
    PredictedAccuracy,
    measurement_cache_dir,
)
from rafl.search.evolution import (
    SearchConfig,
    binding_text,
    cost_fn_for,
    evolve,
    profile_limits,
    search_subnets,
)
from rafl.search.genome import Population
from rafl.search.predictor import tau_meaning
from rafl.search.profile import DeviceProfile, load_profile
from rafl.stages.search import load_search_supernet, server_eval_data
from rafl.supernet.arch import ArchConfig

RESULTS = Path(__file__).resolve().parent / "results"
PROFILES = ("pi4", "jetson-nano", "phone", "server-gpu")
LINES: list[str] = []


def say(text: str = "") -> None:
    print(text, flush=True)
    LINES.append(text)


# ---------------------------------------------------------------------- ofa adapters
# rafl's predictor behind ofa's EvolutionFinder interface: the adapter of bench/search_vs_ofa.py
sys.path.insert(0, str(Path(__file__).resolve().parent))
from search_vs_ofa import OFAAccuracyAdapter  # noqa: E402


class OFABudgetAdapter:
    """Every budget of a profile as ofa's one scalar constraint: ``get_efficiency(arch dict)`` =
    the largest ``cost / budget`` ratio (<= 1 iff every budget is met), priced by rafl's cost
    model one arch per call (``CostModel.cost``, the single-arch fast path), as ofa asks."""

    def __init__(self, cost_model, profile):
        self.cost_model, self.profile = cost_model, profile
        self.limits = profile_limits(profile)

    def get_efficiency(self, arch_dict):
        arch = ArchConfig(arch_dict["ks"], arch_dict["e"], arch_dict["d"], arch_dict["image_size"])
        c = self.cost_model.cost(arch).to_dict()
        if "energy_per_epoch_j" in self.limits:
            c["energy_per_epoch_j"] = energy_per_epoch_j(c["energy_mj"], self.profile)
        return max(c[k] / v for k, v in self.limits.items())


def run_ofa(est, space, cost_model, profile, population, generations, seed):
    from ofa.nas.search_algorithm import EvolutionFinder

    random.seed(seed)
    np.random.seed(seed)
    finder = EvolutionFinder(OFABudgetAdapter(cost_model, profile), OFAAccuracyAdapter(est.predictor, space),
                             population_size=population, max_time_budget=generations, parent_ratio=0.25,
                             mutation_ratio=0.5, arch_mutate_prob=0.1, resolution_mutate_prob=0.5)
    with contextlib.redirect_stdout(io.StringIO()):
        acc, arch, eff = finder.run_evolution_search(1.0, verbose=False)[1]
    return ArchConfig(arch["ks"], arch["e"], arch["d"], arch["image_size"]).canonical(space), float(acc), float(eff)


# ---------------------------------------------------------------------- predictor learning curve
def predictor_curve(measured, n_max: int, seed: int, n_first: int) -> list[dict]:
    """The predictor's cross-validated Kendall tau and RMSE against the number of measured subnets:
    ``n_max`` subnets measured (the predictor's ``n_first``, then more drawn by
    :func:`sample_across_space` with the next seed), then random subsets of 1/8, 1/4, 1/2 and all
    of them, each fit with :func:`train_predictor`'s defaults (4-fold CV)."""
    from rafl.search.estimators import sample_across_space
    from rafl.search.predictor import train_predictor

    # the predictor's own subnets first (measured already), then others drawn the same way up to n_max
    archs = sample_across_space(measured.space, min(n_max, n_first), seed)
    seen = {a.to_string() for a in archs}
    archs += [a for a in sample_across_space(measured.space, n_max, seed + 1) if a.to_string() not in seen]
    archs = archs[:n_max]
    acc = measured.measure(archs, progress=True, desc="measuring subnets for the learning curve")
    x = Population.from_archs(measured.space, archs).encode()
    order = np.random.default_rng([seed, 77]).permutation(len(archs))
    out = []
    for n in sorted({max(8, n_max // 8), max(8, n_max // 4), max(8, n_max // 2), n_max}):
        idx = order[:n]
        _, fit = train_predictor(x[idx], acc[idx], seed=seed)
        out.append({"n": int(n), "kendall_tau": fit.kendall_tau, "rmse": fit.rmse})
    return out


# ---------------------------------------------------------------------- measurement noise
def noise_ceiling(supernet, val, calib, cfg, n_samples: int, n: int, seed: int) -> dict:
    """How well server-val can rank subnets at all: ``n`` of the predictor's subnets measured on
    two disjoint random halves of server-val; Kendall tau between the two halves' accuracies (a
    reproducibility ceiling for any ranking judged on a split of that size)."""
    from rafl.search.estimators import sample_across_space
    from rafl.search.predictor import kendall_tau

    images, labels = val
    perm = np.random.default_rng([seed, 4242]).permutation(len(labels))
    half = len(perm) // 2
    a, b = np.sort(perm[:half]), np.sort(perm[half:2 * half])
    archs = sample_across_space(supernet.space, n_samples, seed)[:n]
    acc = []
    for idx in (a, b):
        m = MeasuredAccuracy(supernet, (images[idx], labels[idx]), calib, batch_size=cfg.batch_size,
                             calib_batches=cfg.calib_batches, cache_dir=measurement_cache_dir(), workers=None)
        acc.append(m.measure(archs, progress=True, desc="measuring on a half of server-val"))
    full = MeasuredAccuracy(supernet, val, calib, batch_size=cfg.batch_size, calib_batches=cfg.calib_batches,
                            cache_dir=measurement_cache_dir(), workers=None).measure(archs)
    p = float(np.mean(full))
    return {"n": len(archs), "half": int(half), "tau_halves": kendall_tau(acc[0], acc[1]),
            "se_half": float(np.sqrt(p * (1 - p) / half)), "se_full": float(np.sqrt(p * (1 - p) / len(labels))),
            "std_over_subnets": float(np.std(full))}


# ---------------------------------------------------------------------- random baseline
def random_feasible(space, cost_fns, limits, n: int, seed: int, max_draws: int = 200_000):
    """Per profile, the first ``n`` archs of one shared uniform random stream that meet all its
    budgets (uniform over each profile's feasible set; one stream, so archs are shared)."""
    rng = np.random.default_rng(seed)
    picked: dict[str, list[ArchConfig]] = {p: [] for p in limits}
    drawn = 0
    while drawn < max_draws and any(len(v) < n for v in picked.values()):
        pop = Population.sample(space, 2048, rng)
        drawn += len(pop)
        for p in limits:
            if len(picked[p]) >= n:
                continue
            c = cost_fns[p](pop)
            ok = np.ones(len(pop), dtype=bool)
            for k, v in limits[p].items():
                ok &= c[k] <= v
            for i in np.flatnonzero(ok)[: n - len(picked[p])]:
                picked[p].append(pop.arch(int(i)))
    return picked, drawn


# ---------------------------------------------------------------------- latency
def unit_specs(space):
    from rafl.search.units import fixed_units, slot_units

    specs = []
    for r in space.resolutions:
        head, tail = fixed_units(space, r)
        specs += [s for _, s in head + tail] + [s for row in slot_units(space, r) for col in row for s in col]
    return specs


def fit_roofline(specs, lut: dict[str, float]) -> dict[str, float]:
    """Roofline parameters (throughput GMAC/s, bandwidth GB/s, per-layer overhead us) minimizing the
    median relative error over this host's LUT entries (grid search, log-spaced)."""
    ops = [s.op_bytes() for s in specs]
    y = np.array([lut[s.key] for s in specs])
    n_ops = max(len(o) for o in ops)
    macs = np.zeros((len(ops), n_ops))
    nbytes = np.zeros((len(ops), n_ops))
    for i, o in enumerate(ops):
        for j, (m, b) in enumerate(o):
            macs[i, j], nbytes[i, j] = m, b
    best = (np.inf, None)
    for p in np.logspace(-0.5, 2, 26):
        for bw in np.logspace(0, 2.5, 26):
            t = np.maximum(macs / (p * 1e9), nbytes / (bw * 1e9)).sum(axis=1) * 1e3
            for ov in np.linspace(0, 0.2, 41):  # ms
                err = np.median(np.abs(t + ov - y) / y)
                if err < best[0]:
                    best = (err, (p, bw, ov))
    p, bw, ov = best[1]
    return {"throughput_gmacs": float(p), "mem_bandwidth_gbs": float(bw), "layer_overhead_us": float(ov * 1e3),
            "unit_median_rel_err": float(best[0])}


def time_round_robin(modules, repeats: int, warmup: int = 3, statistic=min) -> np.ndarray:
    """Latency (ms) of every ``(module, input)`` on this host: ``warmup + repeats`` rounds, each
    running every module once (load fluctuations spread over all of them), thread CPU clock;
    ``statistic`` of the timed runs (``min``: the run least disturbed by other processes)."""
    samples: list[list[float]] = [[] for _ in modules]
    with torch.inference_mode():
        for rnd in range(warmup + repeats):
            for i, (m, x) in enumerate(modules):
                t = time.thread_time()
                m(x)
                if rnd >= warmup:
                    samples[i].append((time.thread_time() - t) * 1e3)
    return np.array([statistic(s) for s in samples])


def latency_check(supernet, n_archs: int, seed: int, repeats: int, n_calib: int = 20) -> dict:
    """Host latency predicted from a per-layer LUT vs measured whole, over ``n_archs`` random subnets.

    The LUT is what ``rafl profile --build-lut --clock thread --statistic min --calibrate N`` writes
    (:func:`build_latency_lut`: every layer of the space and ``n_calib`` whole random subnets for its
    network correction, all timed round-robin, minimum of ``repeats`` runs); the evaluated subnets
    are other random subnets, timed the same way (:func:`time_round_robin`).
    """
    from scipy.stats import spearmanr

    from rafl.search.latency import build_latency_lut, latency_lut_correction
    from rafl.supernet import extract_subnet

    space = supernet.space
    specs = unit_specs(space)
    rng = np.random.default_rng(seed)
    archs = [space.smallest(), space.largest()] + [space.sample(rng) for _ in range(n_archs - 2)]
    with tempfile.TemporaryDirectory() as tmp:
        lut_path = Path(tmp) / "host-lut.yaml"
        t0 = time.perf_counter()
        lut = build_latency_lut(specs, lut_path, threads=1, warmup=3, repeats=repeats, progress=False, clock="thread",
                                statistic="min", space=space, calibrate=n_calib, seed=seed + 1)
        t_lut = time.perf_counter() - t0
        a, b = latency_lut_correction(lut_path)
        host = DeviceProfile.from_dict({"name": "host", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                        "latency_lut": str(lut_path)})
        pred_lut = CostModel(space, host).batch(archs)["latency_ms"]
    raw = (pred_lut - b) / a  # the plain sum of the layers' entries
    roof = fit_roofline(specs, lut)
    host_roof = DeviceProfile.from_dict({"name": "host-roofline", **{k: roof[k] for k in
                                                                      ("throughput_gmacs", "mem_bandwidth_gbs",
                                                                       "layer_overhead_us")}})
    pred_roof = CostModel(space, host_roof).batch(archs)["latency_ms"]
    subs = [(extract_subnet(supernet, x).eval(), torch.randn(1, 3, x.r, x.r)) for x in archs]
    measured = time_round_robin(subs, repeats)

    def stats(pred):
        err = (pred - measured) / measured
        return {"within_10pct": float(np.mean(np.abs(err) <= 0.10)), "median_abs_rel_err": float(np.median(np.abs(err))),
                "mean_rel_err": float(np.mean(err)), "spearman": float(spearmanr(pred, measured).statistic)}

    return {"n_archs": len(archs), "n_calib": n_calib, "n_layers": len(lut), "lut_build_s": t_lut, "repeats": repeats,
            "clock": "thread", "statistic": "min",
            "measured_ms": [float(measured.min()), float(np.median(measured)), float(measured.max())],
            "lut": stats(pred_lut), "lut_uncorrected": stats(raw), "lut_correction": {"a": a, "b_ms": b},
            "roofline_fit": roof, "roofline": stats(pred_roof)}


# ---------------------------------------------------------------------- plot
def pareto_plot(path: Path, rows: dict[str, dict], title: str) -> None:
    from rafl.search.pareto import save_picks_plot

    save_picks_plot(path, {n: {"latency_ms": r["rafl"]["latency_ms"], "accuracy": r["rafl"]["accuracy"],
                               "predicted_accuracy": r["rafl"]["predicted_accuracy"],
                               "latency_budget_ms": r["budgets"].get("latency_ms"), "arch": r["rafl"]["arch"]}
                           for n, r in rows.items()}, title=title)


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--supernet", default=None, help="supernet folder (default: the quickstart supernet)")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--predictor-samples", type=int, default=500)
    ap.add_argument("--random", type=int, default=1000, help="random feasible subnets measured per profile")
    ap.add_argument("--population", type=int, default=100)
    ap.add_argument("--generations", type=int, default=500)
    ap.add_argument("--curve", type=int, default=1000,
                    help="measure this many subnets for the predictor's learning curve (0: skip)")
    ap.add_argument("--noise-ceiling", type=int, default=200,
                    help="predictor subnets also measured on two halves of server-val (0: skip)")
    ap.add_argument("--latency-archs", type=int, default=100)
    ap.add_argument("--latency-repeats", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="suffix of the result files (e.g. -dev)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: random, ofa, latency")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(1)
    names = [n for n in args.profiles.split(",") if n]
    report: dict = {"argv": sys.argv[1:] if argv is None else argv, "threads": 1}
    t_start = time.perf_counter()

    supernet, meta = load_search_supernet(args.supernet, progress=False)
    space = supernet.space
    val, calib, data_info = server_eval_data(meta.get("config"), space, progress=False)
    report["supernet"], report["data"] = meta.get("path"), data_info
    say(f"# Search quality: rafl vs random sampling vs ofa's EvolutionFinder{args.tag and f' ({args.tag})'}")
    say("")
    say(f"supernet `{meta.get('path')}`: width {space.width_mult}, resolutions {list(space.resolutions)}, "
        f"{data_info['dataset']}; server-val {data_info['n_val']} images (accuracy measured there, after BN "
        f"recalibration on 2 x 128 pool-train images); CPU, 1 torch thread")
    say("")

    # --- 1. the predictor
    cfg = SearchConfig(population=args.population, generations=args.generations, progress=False, seed=args.seed,
                       predictor_samples=args.predictor_samples)
    measured = MeasuredAccuracy(supernet, val, calib, batch_size=cfg.batch_size, calib_batches=cfg.calib_batches,
                                cache_dir=measurement_cache_dir(), workers=None)
    t0 = time.perf_counter()
    est = PredictedAccuracy.from_measurements(measured, args.predictor_samples, seed=args.seed, progress=True)
    t_pred = time.perf_counter() - t0
    fit = est.fit.to_dict()
    report["predictor"] = fit | {"seconds": t_pred, "newly_measured": measured.n_measured}
    say("## 1. Accuracy predictor (OFA's recipe)")
    say("")
    say(f"{fit['n_holdout']} subnets sampled across the space (smallest, largest, uniform random with the "
        f"resolution stratified), measured on server-val ({measured.n_measured} newly, the rest from the "
        f"per-supernet cache; {t_pred:.0f} s); an MLP on the one-hot arch encoding, {fit['folds']}-fold "
        "cross-validated:")
    say("")
    say(f"- Kendall tau **{fit['kendall_tau']:.3f}** ({tau_meaning(fit['kendall_tau'])}; target >= 0.7)")
    say(f"- RMSE **{fit['rmse']:.4f}** (accuracy as a fraction; measured accuracies span "
        f"{min(measured.cache.values()):.3f}-{max(measured.cache.values()):.3f})")
    if args.curve:
        curve = predictor_curve(measured, args.curve, args.seed, args.predictor_samples)
        report["predictor_curve"] = curve
        say(f"- More measured subnets ({args.curve} sampled across the space the same way, cross-validated the same "
            "way on subsets): " + ", ".join(f"{c['n']}: tau {c['kendall_tau']:.3f} / RMSE {c['rmse']:.4f}"
                                             for c in curve) + ".")
    if args.noise_ceiling:
        ceiling = noise_ceiling(supernet, val, calib, cfg, args.predictor_samples, args.noise_ceiling, args.seed)
        report["noise_ceiling"] = ceiling
        say(f"- Measurement noise: the same {ceiling['n']} subnets measured on two disjoint random halves of "
            f"server-val ({ceiling['half']} images each) rank with Kendall tau **{ceiling['tau_halves']:.3f}** "
            f"between the halves (the std of one half's accuracy, binomial: ~{ceiling['se_half']:.4f}; of the "
            f"whole split's: ~{ceiling['se_full']:.4f}; the measured accuracies' std over subnets: "
            f"{ceiling['std_over_subnets']:.4f}). The predictor's OOF tau against the whole split "
            f"({fit['kendall_tau']:.3f}) vs this: how much of the ranking the labels can tell at all.")
    say("")

    # --- 2. rafl vs random vs ofa
    profs = [load_profile(n) for n in names]
    models = {p.name: CostModel(space, p) for p in profs}
    cost_fns = {p.name: cost_fn_for(models[p.name]) for p in profs}
    limits = {p.name: profile_limits(p) for p in profs}
    t0 = time.perf_counter()
    results = search_subnets(supernet, profs, val, calib, cfg, cost_models=models)
    t_search = time.perf_counter() - t0
    rows: dict[str, dict] = {}
    for p in profs:
        r = results[p.name]
        rows[p.name] = {"budgets": limits[p.name], "rafl": {
            "arch": r.arch.to_string(), "accuracy": r.accuracy, "predicted_accuracy": r.predicted_accuracy,
            "macs_m": r.cost.macs_m, "latency_ms": r.cost.latency_ms, "found_for": r.found_for,
            "binding": r.binding, "budget_use": r.budget_use}}
    report["search_all_profiles_s"] = t_search

    if "random" not in skip:
        t0 = time.perf_counter()
        picked, drawn = random_feasible(space, cost_fns, limits, args.random, args.seed + 1)
        union = {a.to_string(): a for v in picked.values() for a in v}
        before = measured.n_measured
        measured.measure(list(union.values()), progress=True, desc="measuring random subnets")
        report["random"] = {"per_profile": args.random, "drawn": drawn, "distinct": len(union),
                            "newly_measured": measured.n_measured - before, "seconds": time.perf_counter() - t0}
        for p in profs:
            archs = picked[p.name]
            acc = measured.measure(archs)
            i = int(np.argmax(acc))
            rows[p.name]["random"] = {"n": len(archs), "best_accuracy": float(acc[i]), "best_arch": archs[i].to_string(),
                                      "median_accuracy": float(np.median(acc)),
                                      "rafl_percentile": float(np.mean(acc <= rows[p.name]["rafl"]["accuracy"]))}

    if "ofa" not in skip:
        for p in profs:
            t0 = time.perf_counter()
            arch, pred, eff = run_ofa(est, space, models[p.name], p, args.population, args.generations, args.seed)
            t_ofa = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = evolve(space, est, cost_fns[p.name], limits[p.name], cfg, profile_name=p.name)
            t_rafl = time.perf_counter() - t0
            acc = float(measured.measure([arch])[0])
            rows[p.name]["ofa"] = {"arch": arch.to_string(), "accuracy": acc, "predicted_accuracy": pred,
                                   "max_budget_ratio": eff, "seconds": t_ofa}
            rows[p.name]["rafl_evolve"] = {"seconds": t_rafl, "best_predicted": float(out.scores[0])}

    say("## 2. rafl's pick vs the best of random subnets vs ofa's EvolutionFinder")
    say("")
    say(f"Budgets: the shipped profiles (no override). rafl: `search_subnets` over the {len(profs)} profiles together "
        f"(population {args.population} x {args.generations} generations, top-{cfg.top_k} re-measured, shared "
        f"finalists; {t_search:.0f} s including the predictor). Random: the best measured of the first "
        f"{args.random} uniform random subnets meeting every budget. ofa: `EvolutionFinder` with the same predictor, "
        "the budgets as one constraint (largest cost/budget ratio <= 1), same population and generations; "
        "its best arch measured the same way. Accuracies: measured top-1 on server-val.")
    say("")
    say("| profile | rafl pick | MACs (M) | latency (ms) | binds | rafl acc (pred.) | best random acc | "
        "rafl's percentile among random | ofa acc (pred.) | ofa s | rafl evolve s | speed-up |")
    say("|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    t_ofa_all = t_rafl_all = 0.0
    for name, row in rows.items():
        r = row["rafl"]
        rnd, ofa, ev = row.get("random"), row.get("ofa"), row.get("rafl_evolve")
        arch = r["arch"].replace("|", "\\|")  # a pipe inside a table cell (even in backticks) ends the cell
        cells = [name, f"`{arch}`" + ("" if r["found_for"] == name else f" (found for {r['found_for']})"),
                 f"{r['macs_m']:.2f}", f"{r['latency_ms']:.3f}", binding_text(r["budget_use"]),
                 f"{r['accuracy']:.4f} ({r['predicted_accuracy']:.4f})"]
        cells += [f"{rnd['best_accuracy']:.4f}", f"{100 * rnd['rafl_percentile']:.1f}%"] if rnd else ["-", "-"]
        if ofa:
            t_ofa_all += ofa["seconds"]
            t_rafl_all += ev["seconds"]
            cells += [f"{ofa['accuracy']:.4f} ({ofa['predicted_accuracy']:.4f})", f"{ofa['seconds']:.2f}",
                      f"{ev['seconds']:.2f}", f"{ofa['seconds'] / ev['seconds']:.1f}x"]
        else:
            cells += ["-"] * 4
        say("| " + " | ".join(cells) + " |")
    say("")
    if t_rafl_all:
        report["speedup"] = t_ofa_all / t_rafl_all
        say(f"Speed on the same work (same predictor, budgets, population and generations), all profiles: ofa "
            f"{t_ofa_all:.1f} s, rafl {t_rafl_all:.2f} s: **{t_ofa_all / t_rafl_all:.1f}x** (target >= 10x).")
    archs = {n: r["rafl"]["arch"] for n, r in rows.items()}
    macs = [rows[n]["rafl"]["macs_m"] for n in reversed(PROFILES) if n in rows]
    accs = [rows[n]["rafl"]["accuracy"] for n in reversed(PROFILES) if n in rows]
    ordered_macs = all(a >= b for a, b in itertools.pairwise(macs))
    ordered_acc = all(a >= b for a, b in itertools.pairwise(accs))
    bound = [n for n, r in rows.items() if r["rafl"]["binding"] is not None]
    report["checks"] = {"distinct_subnets": len(set(archs.values())), "ordered_macs": ordered_macs,
                        "ordered_accuracy": ordered_acc, "bound_within_10pct": bound}
    order = " >= ".join(n for n in reversed(PROFILES) if n in rows)
    say(f"Checks: {len(set(archs.values()))} different subnets for {len(rows)} profiles; MACs ordered {order}: "
        f"{'yes' if ordered_macs else 'NO'}; measured accuracy ordered: {'yes' if ordered_acc else 'NO'}; "
        f"picks within 10% of a budget: {len(bound)}/{len(rows)} ({', '.join(bound) or 'none'}).")
    say("")

    # --- 3. latency
    if "latency" not in skip:
        lat = latency_check(supernet, args.latency_archs, args.seed + 2, args.latency_repeats)
        report["latency"] = lat
        lu, ro, rf = lat["lut"], lat["roofline"], lat["roofline_fit"]
        say("## 3. Latency prediction (nn-Meter's measure: share within +-10% of measured)")
        say("")
        say(f"{lat['n_archs']} random subnets (smallest and largest included), measured whole on this host "
            f"(batch 1, 1 thread, thread CPU clock, minimum of {lat['repeats']} round-robin runs; "
            f"{lat['measured_ms'][0]:.2f}-{lat['measured_ms'][2]:.2f} ms) against:")
        say("")
        say("| predictor | within +-10% | median abs. error | mean signed error | Spearman |")
        say("|---|---:|---:|---:|---:|")
        lc, un = lat["lut_correction"], lat["lut_uncorrected"]
        say(f"| host LUT ({lat['n_layers']} layers + network correction a = {lc['a']:.3f}, b = {lc['b_ms']:+.3f} ms "
            f"from {lat['n_calib']} other random subnets; built in {lat['lut_build_s']:.0f} s) | "
            f"**{100 * lu['within_10pct']:.0f}%** | **{100 * lu['median_abs_rel_err']:.1f}%** | "
            f"{100 * lu['mean_rel_err']:+.1f}% | {lu['spearman']:.3f} |")
        say(f"| host LUT, plain sum of the layers | {100 * un['within_10pct']:.0f}% | "
            f"{100 * un['median_abs_rel_err']:.1f}% | {100 * un['mean_rel_err']:+.1f}% | {un['spearman']:.3f} |")
        say(f"| roofline, parameters fit to this host's LUT ({rf['throughput_gmacs']:.2f} GMAC/s, "
            f"{rf['mem_bandwidth_gbs']:.1f} GB/s, {rf['layer_overhead_us']:.0f} us/layer) | "
            f"{100 * ro['within_10pct']:.0f}% | {100 * ro['median_abs_rel_err']:.1f}% | "
            f"{100 * ro['mean_rel_err']:+.1f}% | {ro['spearman']:.3f} |")
        say("")
        say("The shipped device profiles (pi4, jetson-nano, phone, server-gpu) have no measured LUT: their latency "
            "is a **roofline estimate** from datasheet figures. Even with parameters fit to the device (the second "
            f"row) the roofline is off by a median {100 * ro['median_abs_rel_err']:.0f}%; with datasheet parameters "
            "expect more (the throughput and per-layer overhead are assumptions; a factor of ~2 either way is "
            "plausible), so treat their latency budgets as relative. A LUT measured on the device "
            "(`rafl profile --build-lut`) replaces the roofline; see the README.")
        say("")

    # --- 4. the picture
    png = RESULTS / f"search_quality_pareto{args.tag}.png"
    pareto_plot(png, rows, title=f"picks on {data_info['dataset']} ({meta.get('path')})")
    say(f"Picture: `{png.name}` (every profile's pick, measured and predicted accuracy, against its predicted "
        "device latency; each profile's latency budget a dashed line).")
    say("")
    say(f"Total bench time {time.perf_counter() - t_start:.0f} s. Re-run: `python bench/search_quality.py "
        + " ".join(report["argv"]) + "`")
    report["rows"] = rows
    atomic_write_text(RESULTS / f"search_quality{args.tag}.md", "\n".join(LINES) + "\n")
    atomic_write_json(RESULTS / f"search_quality{args.tag}.json", report)
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
