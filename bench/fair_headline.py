"""The fair headline: every method tuned on validation data, scored under both protocols beside a
no-training floor, over seeds, with the tailoring ablation.

Per seed N (``--seeds 0,1,2``), two ``rafl compare`` runs on ``examples/cifar10-devices.yaml``
(``partition.global_test_per_class: 500``: half of the CIFAR-10 test split, 500 per class, held
out from every client and from the supernet):

1. ``OUT/seedN``: every method of ``--methods`` (``pretrained`` is the floor: each client's searched
   subnet, BN recalibrated, no rounds) with ``--tune lr=GRID`` (each method's learning rate picked
   on the clients' validation splits, the same number of trials for every method, picks in
   ``OUT/seedN/tune.json``); the global-model methods also get their fine-tuned rows
   (``uniform-ft``, ``heterofl-ft``, ``fedrolex-ft``).
2. ``OUT/seedN-weakest``: the tailoring ablation, ``--set clients.subnets=weakest`` (every client
   on the one subnet that fits every device) for ``--ablation`` (default standalone, rafl, fedtgp), each with
   the learning rate its tuned run picked.

Then it writes ``bench/results/headline_fair<tag>.md`` / ``.json``:

- per method and protocol (personalized: each client's own test split; global: the held-out
  global test set), the final-round and the last-3-evaluations mean over clients, mean ± SE over
  seeds (SE = sd / sqrt(seeds));
- per method, the aggregation rule it ran under (``engine.aggregation``);
- per method, the paired difference to the floor and to standalone over the clients (mean ± the 95 %
  Student's t half-width of the per-client differences, t_{0.975, n-1} x SE), per seed, and over the
  seeds (mean of the seeds' differences ± t_{0.975, seeds-1} x SE: 4.30 SE for 3 seeds), with ``*``
  only where that interval excludes 0 (:mod:`rafl.reports.stats`);
- the tailoring table: per tier, per-device minus weakest subnet accuracy, paired over the same
  clients (same seed, method and partition), with the same intervals, per seed.

Run: ``python bench/fair_headline.py --data-root R`` (the full benchmark; many CPU hours on 2 cores:
3 lr trials + the final run + the ablation per seed); ``--from OUT`` summarizes finished runs;
``--from-json bench/results/headline_fair.json`` re-renders a summary from its JSON alone (no runs);
``--smoke`` a small version (30 clients, 3 per round, 2 rounds, 200 global test images, a tiny
search) that exercises every part in well under an hour, written with the tag ``_smoke``.

``--tune-seeds 0`` tunes on seed 0 only: every other seed runs each method once with the learning rate
its seed-0 tuning picked (``--set algorithm.METHOD.lr=...``, no trials), the usual protocol for
reporting a tuned configuration over seeds, and about 4x cheaper per seed; the lr column says
whose pick it is. Default: every seed tunes on its own validation splits.

``--jobs N`` runs the comparisons one method at a time, N at once (``OUT/seedN-METHOD``, its
ablation in ``OUT/seedN-weakest-METHOD``): a method's numbers do not depend on which other methods
share its ``rafl compare`` (each is built from the same seed, data and partition), so this only
changes the wall time. ``--device cuda`` runs every client on the GPU (``train.device=cuda``,
``engine.workers=1``, one process per job); a job that fails there is run again on the CPU, and the
log says so. ``bench/gpu_headline.sh`` is that run on a lent GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rafl.reports.stats import format_points, from_se, paired_interval, t_factor, t_interval

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cifar10-devices.yaml"
METHODS = "pretrained,standalone,uniform,heterofl,fedrolex,heterofl+sbn,fedrolex+sbn,rafl,fedgh,fedtgp,fedproto"
ABLATION = "standalone,rafl,fedtgp"
GRID = "0.01,0.03,0.1,0.003"
#: ``METHOD+VARIANT`` in ``--methods``: METHOD with these hyperparameters, in ``OUT/seedN-METHOD+VARIANT``,
#: its rows named ``METHOD+VARIANT`` (and ``METHOD+VARIANT-ft``)
VARIANTS = {
    # HeteroFL's static BN (Sec. 3.2) with its evaluation statistics measured on the server's public pool
    "sbn": {"static_bn": "true", "sbn_statistics": "server"},
    # RaFL's knowledge network as the plain smallest subnet (pretrained, full width) instead of narrowed to 0.375
    "kw1": {"knowledge_width": "1"},
}
TIERS = ("pi4", "jetson-nano", "phone")
#: set when this process is interrupted: its jobs' comparisons stop and resume later, never fall back
STOPPING = False
#: the methods by their wall time in the headline (bench/results/headline_cifar10.md), slowest first
SLOWEST_FIRST = ("heterofl", "fedrolex", "rafl", "fedproto", "fedgh", "fedtgp", "standalone", "uniform", "pretrained")
SMOKE = ["--set", "engine.workers=1", "--set", "clients.n=30", "--set", "engine.clients_per_round=3", "--set", "engine.rounds=2",
         "--set", "engine.eval_every=1", "--set", "partition.global_test_per_class=20",
         "--set", "search.generations=2", "--set", "search.population=8",
         "--set", "search.predictor_samples=8", "--set", "search.val_samples=64"]


def compare(args, out: Path, methods: str, extra: list[str]) -> None:
    if (out / "compare.json").is_file() and (out / "config.yaml").is_file():
        return  # finished (a half-finished one resumes below)
    sets = [x for kv in args.set for x in ("--set", kv)]
    on = ["--set", f"train.device={args.device}", "--set", "engine.workers=1"] if args.device != "cpu" else []

    def command(device_sets: list[str]) -> list[str]:
        cmd = [sys.executable, "-m", "rafl", "compare", "--no-progress"]
        if (out / "config.yaml").is_file():  # --no-finetune again: a record written before it kept the flag
            return cmd + ["--resume", str(out), *(["--no-finetune"] if "--no-finetune" in extra else [])]
        config = getattr(args, "config", CONFIG)  # bench/where_federation_pays.py runs another config
        return cmd + ["--config", str(config.relative_to(ROOT)), "--data-root", str(args.data_root), "--out",
                      str(out), "--algorithms", methods, *extra, *(SMOKE if args.smoke else []), *sets, *device_sets]

    log = out.parent / f"{out.name}.log"
    for device_sets in ([on, ["--set", "engine.workers=1"]] if on else [[]]):
        cmd = command(device_sets)
        start = time.time()
        print("+", " ".join(cmd), flush=True)
        with open(log, "a") as fh:
            fh.write("+ " + " ".join(cmd) + "\n")
            fh.flush()
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
        print(f"  {out.name}: exit {rc} after {time.time() - start:.0f} s", flush=True)
        if rc == 0:
            return
        if rc in (130, 143, -2, -15) or STOPPING:  # interrupted: the folder resumes, it did not fail
            raise SystemExit(f"{out.name}: interrupted (exit {rc}); resumes with the same command")
        if device_sets is on and on:
            print(f"  {out.name}: failed on {args.device}; again on the CPU (see {log.name})", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    raise SystemExit(f"{out.name}: rafl compare failed (exit {rc}); see {log}")


def per_client(folder: Path, row: dict, key: str) -> dict[str, float]:
    """client id -> accuracy (``model.acc`` or ``model@global.acc``) of one row's final round."""
    base = row.get("finetuned_from")
    path = folder / base / "finetuned.json" if base else folder / row["algorithm"] / "summary.json"
    clients = json.loads(path.read_text())["clients"]
    return {c: v[key] for c, v in clients.items() if v.get(key) is not None}


def paired(a: dict[str, float], b: dict[str, float], clients: list[str] | None = None) -> tuple[float, float, int]:
    """Mean of a - b over the clients both have (or ``clients``), its standard error, the count."""
    iv = paired_interval(a, b, clients)
    return iv.mean, iv.se, iv.n


def over_seeds(values: list[float]) -> str:
    """``mean ± SE`` over the seeds (SE = sd / sqrt(seeds)): a row's level, not a test."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / math.sqrt(len(values)):.3f}"


def seeds_flag(means: list[float]) -> str:
    """Mean of per-seed paired differences ± the 95 % t half-width over the seeds (t_{0.975, seeds-1} x
    sd / sqrt(seeds): 4.30 SE for 3 seeds), ``*`` when that interval excludes 0; ``-`` below 2 seeds."""
    iv = t_interval(means)
    return "-" if iv.n < 2 else format_points(iv)


def seed_columns(seeds: list[int], lead: list[str]) -> list[str]:
    """Header and separator of a table with ``lead`` columns, then personalized | global per seed (and
    over the seeds, when there are several)."""
    names = [f"seed {s}" for s in seeds] + (["over seeds"] if len(seeds) > 1 else [])
    return ["| " + " | ".join(lead + [f"{n} {p}" for n in names for p in ("personalized", "global")]) + " |",
            "|" + "---|" * (len(lead) + 2 * len(names))]


def flag(mean: float, se: float, n: int) -> str:
    """A paired difference over ``n`` clients in points: ``mean ± t_{0.975, n-1} x se``, ``*`` when that
    interval excludes 0."""
    return format_points(from_se(mean, se, n))


def variant_sets(method: str) -> tuple[str, list[str]]:
    """``(algorithm, --set arguments)`` of a ``--methods`` entry (``METHOD`` or ``METHOD+VARIANT``)."""
    algorithm, _, variant = method.partition("+")
    if variant and variant not in VARIANTS:
        raise SystemExit(f"--methods: unknown variant {variant!r} in {method!r}; allowed: {', '.join(VARIANTS)}")
    hp = VARIANTS.get(variant, {})
    return algorithm, [x for k, v in hp.items() for x in ("--set", f"algorithm.{algorithm}.{k}={v}")]


def tuning_seeds(args, seeds: list[int]) -> list[int]:
    """The seeds that tune (``--tune-seeds``; default: every seed of the run)."""
    return [int(t) for t in args.tune_seeds.split(",") if t.strip()] if args.tune_seeds is not None else list(seeds)


def picked_lr(folder: Path, algorithm: str) -> float | None:
    """The learning rate ``algorithm``'s tuning picked in the comparison ``folder`` (None: it did not tune)."""
    tune = folder / "tune.json"
    picked = json.loads(tune.read_text()).get("picked", {}).get(algorithm, {}) if tune.is_file() else {}
    return picked.get("lr")


def row_name(row: dict, folder: Path) -> str:
    """A row's method name: its algorithm's, with the folder's ``+VARIANT`` (before any ``-ft``)."""
    name = row["algorithm"]
    variant = folder.name.partition("+")[2]
    if not variant:
        return name
    base = name.removesuffix("-ft")
    return f"{base}+{variant}" + ("-ft" if name.endswith("-ft") else "")


def runs(out: Path, name: str) -> dict[str, tuple[dict, Path]]:
    """method -> (its row in compare.json, the comparison's folder), from ``OUT/NAME`` (every
    method in one comparison) and ``OUT/NAME-METHOD`` (``--jobs``: one comparison per method)."""
    found: dict[str, tuple[dict, Path]] = {}
    for folder in [out / name, *sorted(out.glob(f"{name}-*"))]:
        if folder.name.startswith(f"{name}-weakest") and "weakest" not in name:
            continue
        result = folder / "compare.json"
        if folder.is_dir() and result.is_file():
            for r in json.loads(result.read_text())["rows"]:
                found[row_name(r, folder)] = (r, folder)
    return found


def plot(path: Path, methods: dict, seeds: list[int]) -> None:
    """Both protocols per method (final round, mean over clients; error bars: SE over seeds when
    there are several), the floor's two figures as dashed lines: ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(methods)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.75 * len(names) + 2), 3.8), layout="constrained")
    for j, (key, label, color) in enumerate((("model.acc_mean", "personalized (own test split)", "tab:blue"),
                                             ("model@global.acc_mean", "global (held-out balanced set)", "tab:orange"))):
        values = [[v for v in methods[m][key] if v is not None and not math.isnan(v)] for m in names]
        mean = [statistics.mean(v) if v else float("nan") for v in values]
        se = [statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for v in values]
        ax.bar([i + (j - 0.5) * 0.4 for i in range(len(names))], mean, width=0.4,
               yerr=se if len(seeds) > 1 else None, capsize=2, color=color, label=label)
        if "pretrained" in methods and not math.isnan(mean[names.index("pretrained")]):
            ax.axhline(mean[names.index("pretrained")], color=color, linestyle="--", linewidth=1)
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    ax.set_ylabel("accuracy, final round")
    ax.set_ylim(0.4, 0.95)
    ax.set_title(f"CIFAR-10, 3 devices, 20 clients; seed(s) {', '.join(map(str, seeds))}; dashed: no-training floor",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: the methods that deploy one shared (sliced) global model: their curve says whether training beat the floor
WEIGHT_SHARING = ("uniform", "heterofl", "fedrolex")


def curves(path: Path, where: dict, rows: dict, seeds: list[int], methods: list[str], weakest: dict) -> bool:
    """Global accuracy (mean over the evaluated clients) by round of the weight-sharing methods, one
    panel per seed, the floor's final figure dashed and, where the ablation ran it, the floor on the one
    subnet every device fits (``weakest``: seed -> ``runs(OUT, seedN-weakest)``) dotted: ``path`` (PNG).
    False (nothing written) when no such method has a ``metrics.jsonl``."""
    shared = [m for m in methods if m.partition("+")[0] in WEIGHT_SHARING and not m.endswith("-ft")]
    series: dict[int, dict[str, tuple[list[int], list[float]]]] = {}
    for s in seeds:
        for m in shared:
            log = where[s][m] / rows[s][m]["algorithm"] / "metrics.jsonl"
            if not log.is_file():
                continue
            points = [(d["round"], d["model@global.acc_mean_over_clients"])
                      for d in map(json.loads, log.read_text().splitlines())
                      if d.get("model@global.acc_mean_over_clients") is not None]
            series.setdefault(s, {})[m] = ([r for r, _ in points], [a for _, a in points])
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(seeds), figsize=(3.6 * len(seeds) + 0.6, 3.4), layout="constrained",
                             sharey=True, squeeze=False)
    for ax, s in zip(axes[0], seeds):
        for m, (x, y) in series.get(s, {}).items():
            ax.plot(x, y, marker="o", markersize=3, label=m)
        if "pretrained" in rows[s]:
            ax.axhline(rows[s]["pretrained"]["model@global.acc_mean"], color="black", linestyle="--", linewidth=1,
                       label="pretrained (floor)")
        if "pretrained" in weakest.get(s, {}):
            ax.axhline(weakest[s]["pretrained"][0]["model@global.acc_mean"], color="gray", linestyle=":",
                       linewidth=1.2, label="pretrained, one subnet for all")
        ax.set_title(f"seed {s}", fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("global accuracy, mean over clients")
    axes[0][-1].legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def aggregation_rule(folder: Path) -> str:
    """``engine.aggregation`` of the comparison in ``folder`` (its ``config.yaml``; ``norm_clip``, the
    default, when the file or the field is missing)."""
    import yaml  # only the summary reads configs

    path = folder / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.is_file() else None
    return ((cfg or {}).get("engine") or {}).get("aggregation") or "norm_clip"


def summarize(args, seeds: list[int]) -> str:
    """Collect every finished comparison of ``args.out`` into the result (``headline_fair<tag>.json``) and
    write it out with :func:`render`. Raises ``SystemExit`` when no method finished on every seed."""
    found = {s: runs(args.out, f"seed{s}") for s in seeds}
    rows = {s: {m: r for m, (r, _) in found[s].items()} for s in seeds}
    where = {s: {m: f for m, (_, f) in found[s].items()} for s in seeds}
    listed = args.methods.split(",")
    methods = sorted((m for m in rows[seeds[0]] if all(m in rows[s] for s in seeds)),
                     key=lambda m: (listed.index(m.removesuffix("-ft")) if m.removesuffix("-ft") in listed else 99,
                                    m.endswith("-ft")))
    if not methods:
        raise SystemExit(f"nothing to summarize: no method has finished for seed(s) {', '.join(map(str, seeds))} in "
                         f"{args.out}; {args.results} left as it was")
    tuned = tuning_seeds(args, seeds)
    result: dict = {"seeds": seeds, "tuning_seeds": tuned, "command": {"methods": args.methods, "grid": args.grid,
                                                                       "smoke": bool(args.smoke)},
                    "methods": {}, "tailoring": {}, "trials": []}
    for m in methods:
        rs = [rows[s][m] for s in seeds]
        lrs = []
        for s in seeds:
            tune = where[s][m] / "tune.json"
            base = rows[s][m].get("finetuned_from", rows[s][m]["algorithm"])
            rec = json.loads(tune.read_text()) if tune.is_file() else {}
            picked = rec.get("picked", {}).get(base, {})
            grid = sorted({t["hparams"]["lr"] for t in rec.get("trials", {}).get(base, []) if "lr" in t["hparams"]})
            if not rec and m != "pretrained":  # --tune-seeds: this seed ran with a tuning seed's pick
                source = next((t for t in tuned if t != s and t in where and m in where[t]), None)
                lr = picked_lr(where[source][m], base) if source is not None else None
                lrs.append(f"{lr} (seed {source}'s)" if lr is not None else "-")
                continue
            lrs.append(str(picked.get("lr", "-")) + (f" of {'/'.join(map(str, grid))}" if grid else ""))
            if grid and not m.endswith("-ft"):
                result["trials"].append([s, m, [[t["hparams"].get("lr"), t["val_acc"]] for t in rec["trials"][base]]])
        entry = {k: [r.get(k, float("nan")) for r in rs]
                 for k in ("model.acc_mean", "model.acc_mean_last3", "model@global.acc_mean", "model@global.acc_mean_last3")}
        result["methods"][m] = {**entry, "lr": lrs, "aggregation": [aggregation_rule(where[s][m]) for s in seeds],
                                "mb": [rs[0].get("mb_up_per_client_round", 0), rs[0].get("mb_down_per_client_round", 0)]}
    for ref in ("pretrained", "standalone"):
        if ref not in methods:
            continue
        for m in methods:
            if m == ref:
                continue
            for s in seeds:
                for key in ("model.acc", "model@global.acc"):
                    mean, se, n = paired(per_client(where[s][m], rows[s][m], key),
                                         per_client(where[s][ref], rows[s][ref], key))
                    result["methods"][m].setdefault(f"vs_{ref}", {}).setdefault(key, []).append([mean, se, n])
    ablation = [m for m in args.ablation.split(",") if m in methods]
    pinned_runs = {s: runs(args.out, f"seed{s}-weakest") for s in seeds}
    ablation = [m for m in ablation if all(m in pinned_runs[s] for s in seeds)]
    for m in ablation:
        for tier in TIERS:
            for s in seeds:
                folder = where[s][m]
                prow, pinned = pinned_runs[s][m]
                table = json.loads((folder / rows[s][m]["algorithm"] / "clients.json").read_text())["clients"]
                ids = [str(r["client"]) for r in table if r["profile"] == tier]
                for key in ("model.acc", "model@global.acc"):
                    mean, se, n = paired(per_client(folder, rows[s][m], key), per_client(pinned, prow, key), ids)
                    result["tailoring"].setdefault(m, {}).setdefault(tier, {}).setdefault(key, []).append([mean, se, n])
    tag = "_smoke" if args.smoke else ""
    args.results.mkdir(parents=True, exist_ok=True)
    result["curves"] = curves(args.results / f"headline_fair{tag}_curves.png", where, rows, seeds, methods, pinned_runs)
    return render(result, args.results)


def render(result: dict, results: Path) -> str:
    """``headline_fair<tag>.md`` / ``.json`` / ``.png`` in ``results`` from a summary's ``result`` alone (what
    ``--from-json`` re-renders without the runs); returns the Markdown.

    Intervals: a paired difference over a seed's ``n`` clients is ``mean ± t_{0.975, n-1} x SE``; over seeds,
    the mean of the seeds' differences ± t_{0.975, seeds-1} x SE over seeds (4.30 SE for 3 seeds); ``*`` only
    where that interval excludes 0 (:mod:`rafl.reports.stats`).
    """
    seeds, tuned, methods = result["seeds"], result["tuning_seeds"], list(result["methods"])
    command, smoke = result["command"], result["command"].get("smoke", False)
    variants = " ".join(f"`METHOD+{v}` rows are METHOD with `{', '.join(f'{k}: {x}' for k, x in hp.items())}`, tuned "
                        "over the same grid in their own comparison." for v, hp in VARIANTS.items()
                        if any(m.removesuffix("-ft").partition("+")[2] == v for m in methods))
    t_seeds = f"{t_factor(len(seeds)):.2f}" if len(seeds) > 1 else "-"
    lines = [f"# Fair headline: resource-aware FL on CIFAR-10{' (smoke scale)' if smoke else ''}", "",
             f"Seeds {', '.join(map(str, seeds))}; per seed `rafl compare --config examples/cifar10-devices.yaml "
             f"--algorithms {command['methods']} --tune lr=GRID --set seed=N` (each method's grid in the table; "
             f"this run's default: {command['grid']}) (+ the ablation with "
             "`--set clients.subnets=weakest`)"
             + (f"; only seed(s) {', '.join(map(str, tuned))} tune, the others run each method once with seed "
                f"{tuned[0]}'s picked lr" if any(s not in tuned for s in seeds) else "")
             + f". Written by `python bench/fair_headline.py{' --smoke' if smoke else ''}`.", "",
             "Two protocols. **Personalized**: each client's deployed model on its own label-skewed test split "
             "(HtFLlib / PFLlib / FedTGP). **Global**: the same models on the held-out balanced global test set "
             "(HeteroFL / FedRolex / DepthFL); no client and no supernet saw it. `pretrained` is the no-training "
             "floor; `-ft` rows fine-tune the final global model locally for the same local epochs. Learning rates "
             "were picked per method on the clients' validation splits (`tune.json` per seed). The aggregation "
             "column is the server's rule (`engine.aggregation`) each row ran under, per seed.", "",
             *([variants, ""] if variants else []),
             f"Mean over clients, mean ± SE over {len(seeds)} seed(s) (SE = sd / sqrt(seeds)): final round, and "
             "the mean of the last 3 evaluations. Intervals of differences are 95 % Student's t intervals: over a "
             "seed's n clients ± t(0.975, n−1) × SE (2.09 for 20 clients), over the seeds ± t(0.975, seeds−1) × SE "
             f"({t_seeds} for {len(seeds)} seeds); `*` marks a difference whose interval excludes 0. On the global "
             "protocol every client is scored on the same held-out images, so the client-paired interval leaves out "
             "the test set's own sampling noise (one model at 0.78 on 5,000 images: ± 0.6 points).", "",
             "| method | personalized, final | personalized, last 3 | global, final | global, last 3 | lr picked "
             "of the grid (per seed) | aggregation | MB up / down per client-round |", "|---|---|---|---|---|---|---|---|"]
    for m in methods:
        entry = result["methods"][m]
        keys = ("model.acc_mean", "model.acc_mean_last3", "model@global.acc_mean", "model@global.acc_mean_last3")
        rules = sorted(set(entry.get("aggregation", [])))
        up, down = entry.get("mb", [0, 0])
        lines.append(f"| {m} | " + " | ".join(over_seeds(entry[k]) for k in keys) + f" | {' / '.join(entry['lr'])} | "
                     f"{' / '.join(rules) or '-'} | {up:.3f} / {down:.3f} |")
    if result.get("trials"):
        lines += ["", "Tuning trials: validation accuracy (pooled over the clients' validation splits, mean of the "
                  "last 3 evaluations) per learning rate; the picked one is in bold.", "",
                  "| seed | method | " + "validation accuracy by lr |", "|---|---|---|"]
        for s, m, got in result["trials"]:
            best = max(range(len(got)), key=lambda j: (got[j][1] if got[j][1] is not None else -1, -j))
            cells = [(f"**{lr}: {acc:.3f}**" if j == best else f"{lr}: {acc:.3f}") if acc is not None else f"{lr}: -"
                     for j, (lr, acc) in sorted(enumerate(got), key=lambda jg: jg[1][0])]
            lines.append(f"| {s} | {m} | {', '.join(cells)} |")
    many = len(seeds) > 1
    over = (f"; over seeds: the mean of the seeds' differences ± t(0.975, {len(seeds) - 1}) × SE over seeds" if many
            else "")
    for ref in ("pretrained", "standalone"):
        if ref not in methods:
            continue
        lines += ["", f"Paired difference to **{ref}** over the clients every method evaluated (points, 95 % t "
                  f"interval over the clients; `*`: it excludes 0), per seed: personalized | global{over}.", "",
                  *seed_columns(seeds, ["method"])]
        for m in methods:
            if m == ref:
                continue
            diffs = result["methods"][m][f"vs_{ref}"]
            cells = [flag(*diffs[key][i]) for i in range(len(seeds)) for key in ("model.acc", "model@global.acc")]
            if many:
                cells += [seeds_flag([d[0] for d in diffs[key]]) for key in ("model.acc", "model@global.acc")]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if result["tailoring"]:
        lines += ["", "**Tailoring ablation**: per-device subnets minus every client on the one subnet that fits every "
                  "device (`clients.subnets=weakest`: the weakest device's own when the budgets nest, else one searched "
                  "under every budget at once) "
                  "(same method, seed, partition and lr), paired over each tier's clients (points, 95 % t interval; "
                  f"`*`: it excludes 0), per seed: personalized | global{over}.", "",
                  *seed_columns(seeds, ["method", "tier"])]
        for m, tiers in result["tailoring"].items():
            for tier, diffs in tiers.items():
                cells = [flag(*diffs[key][i]) + f" (n={diffs[key][i][2]})"
                         for i in range(len(seeds)) for key in ("model.acc", "model@global.acc")]
                if many:
                    cells += [seeds_flag([d[0] for d in diffs[key]]) for key in ("model.acc", "model@global.acc")]
                lines.append(f"| {m} | {tier} | " + " | ".join(cells) + " |")
    tag = "_smoke" if smoke else ""
    results.mkdir(parents=True, exist_ok=True)
    figure = results / f"headline_fair{tag}.png"
    plot(figure, result["methods"], seeds)
    lines[1:1] = ["", f"![both protocols per method]({figure.name})"]
    if result.get("curves"):
        lines += ["", "The weight-sharing methods' global accuracy by round (mean over the clients evaluated so far), "
                  "per seed; dashed: the floor; dotted: the floor with every client on the one subnet every device fits "
                  "(uniform's starting point).", "", f"![global accuracy by round](headline_fair{tag}_curves.png)"]
    text = "\n".join(lines) + "\n"
    (results / f"headline_fair{tag}.md").write_text(text)
    (results / f"headline_fair{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "rafl-data" / "cifar10")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "headline-fair")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--ablation", default=ABLATION, help="methods of the tailoring ablation")
    ap.add_argument("--grid", default=GRID, help="the learning rates every method is tuned over")
    ap.add_argument("--smoke", action="store_true", help="a small CIFAR-10 version (minutes)")
    ap.add_argument("--from", dest="from_dir", type=Path, default=None, help="summarize finished runs in this folder")
    ap.add_argument("--from-json", dest="from_json", type=Path, default=None,
                    help="re-render a summary's JSON (headline_fair.json) into --results: the tables and the figure, "
                         "no run needed")
    ap.add_argument("--tune-seeds", default=None,
                    help="the seeds that tune (e.g. 0); every other seed runs with the first one's picks "
                         "(needs --jobs N; default: every seed tunes)")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results",
                    help="where headline_fair.md / .json are written")
    ap.add_argument("--jobs", type=int, default=0,
                    help="run one comparison per method and seed, this many at once (0: one per seed, in turn)")
    ap.add_argument("--device", default="cpu", help="train.device of every run (cuda: falls back to the CPU per job)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every rafl compare")
    args = ap.parse_args(argv)
    if args.from_json is not None:
        if not args.from_json.is_file():
            ap.error(f"--from-json {args.from_json}: no such file")
        print(render(json.loads(args.from_json.read_text()), args.results))
        return 0
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    for m in args.methods.split(","):  # bad input: one line, exit 2 (argparse's error)
        try:
            variant_sets(m)
        except SystemExit as err:
            ap.error(str(err))
        if "+" in m and args.jobs <= 0 and args.from_dir is None:
            ap.error(f"--methods {m}: a METHOD+VARIANT runs in its own comparison; add --jobs N")
    tuners = tuning_seeds(args, seeds)
    if args.tune_seeds is not None and (not tuners or args.jobs <= 0 and args.from_dir is None):
        ap.error("--tune-seeds: give at least one seed (e.g. 0) and add --jobs N")
    if args.from_dir is not None:
        args.out = args.from_dir
    elif args.jobs > 0:
        args.out.mkdir(parents=True, exist_ok=True)
        methods = args.methods.split(",")
        # the slowest first, so the pool's last jobs are short ones
        order = {m: i for i, m in enumerate(SLOWEST_FIRST)}
        jobs = sorted(((s, m) for s in seeds for m in methods),
                      key=lambda sm: (order.get(sm[1].partition("+")[0], 99), sm[0]))
        if "pretrained" in methods:  # the decoded images and the search land in the caches once, before the rest
            compare(args, args.out / f"seed{seeds[0]}-pretrained", "pretrained", ["--set", f"seed={seeds[0]}"])

        def job(sm: tuple[int, str]) -> None:
            s, m = sm
            folder = args.out / f"seed{s}-{m}"
            source = folder if s in tuners else args.out / f"seed{tuners[0]}-{m}"  # whose tuning picks the lr
            algorithm, hp = variant_sets(m)
            if m == "pretrained":
                how: list[str] = []
            elif s in tuners:
                how = ["--tune", f"lr={args.grid}"]
            else:  # a tuning seed's pick, from its finished comparison
                lr = picked_lr(source, algorithm)
                if lr is None:
                    raise SystemExit(f"seed{s}-{m}: seed {tuners[0]} has not tuned {m} (no "
                                     f"seed{tuners[0]}-{m}/tune.json); run --seeds {tuners[0]} first")
                how = ["--set", f"algorithm.{algorithm}.lr={lr}"]
            compare(args, folder, algorithm, how + ["--set", f"seed={s}", *hp])
            if m in args.ablation.split(","):
                lr = picked_lr(source, algorithm)
                lrs = ["--set", f"algorithm.{algorithm}.lr={lr}"] if lr is not None else []
                compare(args, args.out / f"seed{s}-weakest-{m}", algorithm,
                        ["--set", f"seed={s}", "--set", "clients.subnets=weakest", "--no-finetune", *hp, *lrs])

        global STOPPING
        failed: list[str] = []
        with ThreadPoolExecutor(args.jobs) as pool:
            try:
                # the tuning seeds' jobs finish before the others start: those take their picks
                for phase in ([sm for sm in jobs if sm[0] in tuners], [sm for sm in jobs if sm[0] not in tuners]):
                    for future in [pool.submit(job, sm) for sm in phase]:
                        try:
                            future.result()
                        except SystemExit as err:
                            print(err, flush=True)
                            failed.append(str(err))
            except KeyboardInterrupt:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # `timeout` signals the child and its group: twice
                STOPPING = True  # the comparisons got the same SIGINT (one process group) and stop
                print("interrupted: every unfinished comparison resumes with the same command", flush=True)
                pool.shutdown(wait=True, cancel_futures=True)
                return 130
        if failed:  # what finished is summarized; the run says it is incomplete
            with contextlib.suppress(SystemExit):
                print(summarize(args, seeds))
            print(f"{len(failed)} comparison(s) failed or could not start (above)", flush=True)
            return 1
    else:
        for s in seeds:
            folder = args.out / f"seed{s}"
            compare(args, folder, args.methods, ["--tune", f"lr={args.grid}", "--set", f"seed={s}"])
            picked = json.loads((folder / "tune.json").read_text()).get("picked", {})
            lrs = [x for m in args.ablation.split(",") if "lr" in picked.get(m, {})
                   for x in ("--set", f"algorithm.{m}.lr={picked[m]['lr']}")]
            compare(args, args.out / f"seed{s}-weakest", args.ablation,
                    ["--set", f"seed={s}", "--set", "clients.subnets=weakest", "--no-finetune", *lrs])
    print(summarize(args, seeds))


if __name__ == "__main__":
    sys.exit(main())
