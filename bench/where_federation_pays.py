"""Where federation pays (issue 56, items 5 and 8): the map of server-pool size x images per client, for
the floor, standalone, FedAvg with server BN statistics, the best HtFL method and RaFL, under all three
protocols, at 10 % participation.

Cells: pool size {5,000 (``cifar10-proxy5k``, ``partition.public_fraction 0.1``), 20,000 (the shipped
``cifar10``, ``public_fraction 0.5``: 20,000 train + 5,000 server-val)} x images per client {~90, ~450,
1,500}. Every cell is one ``rafl compare`` per method on ``examples/cifar10-cross-device-500.yaml``
(balanced-dirichlet label skew, alpha ``--alpha``; 20 % of the clients held out as new clients) with
``clients.n`` = the cell's clients: the clients' images (the train split outside the pool and the test
split outside the 5,000 global test images, 90 % of each client's share for training) over the images
per client. One seed per cell (``--seed``). Methods (``--methods``): ``pretrained`` (the floor),
``standalone``, ``uniform+sbn`` (FedAvg, ``train.bn_statistics=server``; ``uniform+sbn+m``: with FedAvgM's server
momentum 0.9), ``centralized`` (the ceiling, on request), the HtFL method ``--htfl``
(default fedgh, the fair headline's best), ``rafl+kw1`` (RaFL, knowledge network at full width). Every
method but the floor is tuned on the clients' validation splits over ``--grid`` (``rafl compare --tune``,
as ``bench/fair_headline.py``); with ``--lr-from PER_CLIENT`` only that images-per-client cell of each pool
is tuned, and the pool's other cells run each method once at its pick there (the same budget for every
method; the fair headline's ``--tune-seeds 0``, over cells instead of seeds). A pick at the edge of the
grid extends that method's grid by the next half-decade value (:data:`LADDER`, at most
:data:`MAX_EXTENSIONS` times) and makes its final run again.

Resumable: the comparisons are ``bench/fair_headline.py``'s (:func:`fair_headline.compare`): a finished
cell-method (``compare.json``) is skipped, an interrupted one resumes with the same command. Before it
starts it prints its CPU budget estimate (:func:`budget`: training image-steps and global-set scorings at
rates measured on the 450-image cell) and refuses bad input (one line, exit 2, nothing written).

Writes ``bench/results/where_federation_pays.md`` / ``.json`` / ``.png``: per cell and method the mean over
clients in each protocol, and the paired gain over the floor and over standalone (points, mean over the
clients both scored ± the 95 % Student's t half-width, ``*`` where the interval excludes 0,
:mod:`rafl.reports.stats`); the figure shows the gain over the floor on the global protocol and over
standalone on new clients per cell, with those intervals; the (20,000, 1,500) cell is marked as the fair
headline's null result.

Run: ``python bench/where_federation_pays.py --data-root R --jobs 2`` (CPU); ``bench/gpu_map.sh`` on a lent
GPU (several cells at once); ``--from OUT`` summarizes what finished.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fair_headline as fh  # noqa: E402

from rafl.federation.catalog import method_catalog  # noqa: E402
from rafl.reports.stats import Interval, format_points, paired_interval  # noqa: E402

ROOT = fh.ROOT
CONFIG = ROOT / "examples" / "cifar10-cross-device-500.yaml"
#: pool size -> (supernet, partition.public_fraction, client images: train outside the pool + test outside the global
#: set, the supernet's server-val size: ``search.val_samples``, so the search reads the measurements shipped with it)
POOLS = {5000: ("cifar10-proxy5k", 0.1, 45_000 + 5_000, 1000), 20000: ("cifar10", 0.5, 25_000 + 5_000, 5000)}
PER_CLIENT = (90, 450, 1500)
HTFL = ("fedgh", "fedtgp", "fedproto")
#: the cell the fair headline measured (20 clients x ~1,500 images, the shipped 20,000-image pool): no method
#: beat the floor there
NULL_CELL = (20000, 1500)
#: train share of a client's images (the config's partition.split)
TRAIN_SHARE = 0.9
#: the smallest client partition.min_samples allows (the config's)
MIN_SAMPLES = 20
#: the fewest clients a cell may have: with 20 % held out, at least one new client and four that train
MIN_CLIENTS = 5
#: CPU seconds per image-step of local training on one core, measured: the 450-image cell's final runs
#: (``where_federation_pays_runs/pool5000-pc450``, ``time_client_update_s`` over the sampled clients'
#: training images: standalone 0.008, FedAvg 0.005, FedGH 0.018, RaFL+kw1 0.019), their mean
SECONDS_PER_IMAGE_STEP = 0.013
#: CPU seconds to score one deployed model on the global test set (5,000 images) and a client's own split,
#: measured in the same cell: standalone's 632 s of evaluation over 2 evaluations of 100 clients
SECONDS_PER_SCORING = 3.2
#: methods whose clients of one device tier deploy one model (the global set is scored once per tier
#: and evaluation: ``Algorithm.evaluates_state_only``), and the config's tiers
SHARED_MODELS = ("pretrained", "uniform+sbn", "uniform+sbn+m", "uniform+sbn+mean", "centralized")
TIERS = 3
#: the config's ``engine.eval_every``: evaluations happen every this many rounds (the floor's once)
EVAL_EVERY = 10
#: the learning rates a grid is extended with, in half-decade steps, when a pick sits at its edge
LADDER = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
#: how many times one method's grid may be extended in one cell
MAX_EXTENSIONS = 2
#: ``--methods`` entries beyond fair_headline's METHOD+VARIANT: their --set arguments
MAP_VARIANTS = {"uniform+sbn": ("uniform", ["--set", "train.bn_statistics=server"]),
                # FedAvgM (Hsu et al. 2019): server momentum 0.9, the paper's usual value, server lr 1
                "uniform+sbn+m": ("uniform", ["--set", "train.bn_statistics=server", "--set", "algorithm.server_momentum=0.9"]),
                # the published aggregation rule (sample-weighted mean, McMahan et al. 2017) beside the default
                # norm_clip every other row runs under (issue 56, item 7)
                "uniform+sbn+mean": ("uniform", ["--set", "train.bn_statistics=server", "--set", "engine.aggregation=mean"]),
                "fedgh+mean": ("fedgh", ["--set", "engine.aggregation=mean"])}
PROTOCOLS = (("model.acc", "personalized"), ("model@global.acc", "global"), ("new", "new clients"))


def die(message: str) -> None:
    """Bad input: one line on stderr, exit 2, nothing written."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def cell_clients(pool: int, per_client: int) -> int:
    """Clients of a cell: the clients' training images over ``per_client`` (at least 1)."""
    return max(1, round(POOLS[pool][2] * TRAIN_SHARE / per_client))


def method_sets(method: str, htfl: str) -> tuple[str, list[str]]:
    """``(algorithm, --set arguments)`` of a map method (``htfl`` names the HtFL method's row)."""
    if method in MAP_VARIANTS:
        return MAP_VARIANTS[method]
    return fh.variant_sets(method)


def check_args(args) -> tuple[list[int], list[int], list[str]]:
    """Parsed ``(pools, per_client, methods)``; bad input exits 2 with one line (:func:`die`)."""
    try:
        pools = [int(p) for p in args.pools.split(",") if p.strip()]
        per = [int(p) for p in args.per_client.split(",") if p.strip()]
    except ValueError:
        die(f"--pools {args.pools!r} / --per-client {args.per_client!r}: allowed: comma-separated integers")
    bad = [p for p in pools if p not in POOLS]
    if not pools or bad:
        die(f"--pools: {bad or 'none'} not allowed; allowed: {', '.join(map(str, POOLS))}")
    if not per or any(p < MIN_SAMPLES for p in per):
        die(f"--per-client: {args.per_client}; allowed: integers >= {MIN_SAMPLES} (partition.min_samples)")
    if args.htfl not in HTFL:
        die(f"--htfl: {args.htfl!r}; allowed: {', '.join(HTFL)}")
    methods = [m.strip() for m in args.methods.replace("HTFL", args.htfl).split(",") if m.strip()]
    catalog = method_catalog()  # the registered methods and their hyperparameters, read without torch
    for m in methods:
        if m in MAP_VARIANTS:
            continue
        algorithm, _, variant = m.partition("+")
        if algorithm not in catalog:
            die(f"--methods: unknown algorithm {algorithm!r} in {m!r}; allowed: {', '.join(catalog)}, or one of "
                f"{', '.join(MAP_VARIANTS)}")
        if variant and variant not in fh.VARIANTS:
            die(f"--methods: unknown variant {variant!r} in {m!r}; allowed: METHOD+VARIANT with VARIANT one of "
                f"{', '.join(fh.VARIANTS)}, or one of {', '.join(MAP_VARIANTS)}")
        missing = [k for k in fh.VARIANTS.get(variant, {}) if k not in catalog[algorithm]]
        if missing:
            die(f"--methods: {m!r}: {algorithm} has no hyperparameter {', '.join(missing)}; allowed: the variant "
                f"on a method that has it ({', '.join(f'{v}: {sorted(h)}' for v, h in fh.VARIANTS.items())})")
    if "pretrained" not in methods or "standalone" not in methods:
        die("--methods: the map's references pretrained and standalone must be in it")
    if args.lr_from is not None and args.lr_from not in per:
        die(f"--lr-from {args.lr_from}: allowed: one of --per-client ({args.per_client})")
    if args.rounds < 1 or not 0 < args.participation <= 1:
        die(f"--rounds {args.rounds} / --participation {args.participation}: allowed: rounds >= 1, participation "
            "in (0, 1]")
    if not (math.isfinite(args.alpha) and args.alpha > 0) or args.local_epochs < 1:
        die(f"--alpha {args.alpha} / --local-epochs {args.local_epochs}: allowed: alpha a finite number > 0, "
            "local epochs >= 1")
    try:
        grid = [float(v) for v in args.grid.split(",")]
    except ValueError:
        grid = []
    if not grid or not all(math.isfinite(v) and v > 0 for v in grid):
        die(f"--grid {args.grid!r}: allowed: comma-separated learning rates, each a finite number > 0")
    for kv in args.set:
        if "=" not in kv or not kv.partition("=")[0].strip():
            die(f"--set {kv!r}: allowed: KEY=VALUE (a run-config key, as rafl compare --set)")
    for pool in pools:
        for p in per:
            n = cell_clients(pool, p)
            if n < MIN_CLIENTS:
                most = POOLS[pool][2] * TRAIN_SHARE // MIN_CLIENTS
                die(f"cell (pool {pool}, {p} per client): {n} client(s); allowed: --per-client <= {most:g} "
                    f"({MIN_CLIENTS} clients or more: 20 % of them are new clients)")
            need = n * MIN_SAMPLES
            if need > POOLS[pool][2]:
                die(f"cell (pool {pool}, {p} per client): {n} clients x partition.min_samples {MIN_SAMPLES} = {need} > "
                    f"{POOLS[pool][2]} client images; allowed: --per-client >= {MIN_SAMPLES}")
    if args.from_dir is None and not args.data_root.exists():
        die(f"--data-root {args.data_root}: no such file or folder; allowed: CIFAR-10's folder or its "
            "cifar10-jpeg.tar.gz (docs/data.md)")
    return pools, per, methods


def budget(pools: list[int], per: list[int], methods: list[str], args) -> float:
    """Estimated CPU hours: per cell and method, (trials + final run) x [rounds x sampled clients x images
    x local epochs image-steps x :data:`SECONDS_PER_IMAGE_STEP` (the floor trains nothing) + evaluations
    x distinct deployed models x :data:`SECONDS_PER_SCORING`] (one model per tier for
    :data:`SHARED_MODELS`, one per client otherwise; ``rounds // EVAL_EVERY`` evaluations, the floor's
    one). Both rates were measured on the 450-image cell; cell-methods finished in ``args.out`` count nothing."""
    seconds = 0.0
    for pool in pools:
        for p in per:
            trials = 1 if args.lr_from is not None and args.lr_from != p else len(args.grid.split(",")) + 1
            n = cell_clients(pool, p)
            sampled = max(1, round(n * (1 - 0.2) * args.participation))
            for m in methods:
                out = getattr(args, "out", None)
                if out is not None and (cell_dir(out, pool, p, m) / "compare.json").is_file():
                    continue  # finished
                models = TIERS if m in SHARED_MODELS else n
                if m == "pretrained":
                    seconds += models * SECONDS_PER_SCORING
                    continue
                train = args.rounds * sampled * p * args.local_epochs * SECONDS_PER_IMAGE_STEP
                scoring = max(1, args.rounds // EVAL_EVERY) * models * SECONDS_PER_SCORING
                seconds += trials * (train + scoring)
    return seconds / 3600


def cell_dir(out: Path, pool: int, per: int, method: str) -> Path:
    return out / f"pool{pool}-pc{per}" / method


def cell_sets(pool: int, per: int, args, method: str) -> list[str]:
    """The cell's ``--set`` arguments for ``method`` (the floor trains nothing: no local epochs). Every
    row starts from each method's own BatchNorm rule (``train.bn_statistics=null``, over the config's
    ``server``): a row that re-estimates on the pool says so in its variant (``uniform+sbn``)."""
    supernet, fraction, _, server_val = POOLS[pool]
    sets = ["train.bn_statistics=null", f"supernet={supernet}", f"partition.public_fraction={fraction}",
            f"search.val_samples={server_val}", f"clients.n={cell_clients(pool, per)}",
            f"engine.rounds={args.rounds}", f"engine.clients_per_round={args.participation}",
            f"partition.alpha={args.alpha}", f"seed={args.seed}"]
    if method != "pretrained":
        sets.append(f"algorithm.local_epochs={args.local_epochs}")
    return [x for s in sets for x in ("--set", s)]


def picked_lr(folder: Path) -> float:
    """The learning rate ``rafl compare --tune`` picked in ``folder`` (its ``tune.json``).

    Raises:
        SystemExit: the folder's tuning has not finished (exit 2, one line)."""
    path = folder / "tune.json"
    record = json.loads(path.read_text()) if path.is_file() else {}
    if not record.get("picked"):
        die(f"--lr-from: {folder} has no finished tuning (tune.json with a pick); run that cell first")
    (method, pick), = record["picked"].items()
    return float(record["trials"][method][pick["trial"]]["hparams"]["lr"])


def tuned_grid(folder: Path) -> list[float]:
    """The learning rates the tuning in ``folder`` tried (``tune.json``), in trial order."""
    record = json.loads((folder / "tune.json").read_text())
    (trials,) = record["trials"].values()
    return [float(t["hparams"]["lr"]) for t in trials]


def tried_grid(folder: Path, grid: list[float]) -> list[float]:
    """``grid`` followed by the learning rates an interrupted tuning in ``folder`` had tried beyond it
    (its ``tune/trial*/config.yaml``, in trial order): a resumed tuning starts from the grid it reached."""
    import yaml  # only a resumed tuning reads trial configs

    out = list(grid)
    trials = sorted((folder / "tune").glob("trial*/config.yaml"), key=lambda f: int(f.parent.name[5:] or 0))
    for path in trials:
        algorithms = (yaml.safe_load(path.read_text()) or {}).get("algorithms") or {}
        for hp in algorithms.values():
            lr = float(hp["lr"]) if isinstance(hp, dict) and "lr" in hp else None
            if lr is not None and not any(math.isclose(lr, v) for v in out):
                out.append(lr)
    return out


def wider(grid: list[float], pick: float) -> list[float] | None:
    """``grid`` with the next :data:`LADDER` value beyond ``pick`` appended when ``pick`` is the grid's
    lowest or highest value (and the ladder goes on), else None: the pick is inside the grid."""
    lo, hi = min(grid), max(grid)
    if pick not in LADDER:
        return None
    if pick == lo and pick != hi and LADDER.index(pick) > 0:
        return [*grid, LADDER[LADDER.index(pick) - 1]]
    if pick == hi and pick != lo and LADDER.index(pick) < len(LADDER) - 1:
        return [*grid, LADDER[LADDER.index(pick) + 1]]
    return None


def run_cell(args, pool: int, per: int, method: str) -> None:
    """One method of one cell: the floor as it is; a tuned method over ``--grid``, the grid extended
    by one :data:`LADDER` step (and the final run made again) while its pick sits at an edge, at
    most :data:`MAX_EXTENSIONS` times; with ``--lr-from`` the pool's other cells once at that pick."""
    algorithm, hp = method_sets(method, args.htfl)
    folder = cell_dir(args.out, pool, per, method)
    folder.parent.mkdir(parents=True, exist_ok=True)
    rest = ["--no-finetune", *cell_sets(pool, per, args, method), *hp]
    if method == "pretrained":
        fh.compare(args, folder, algorithm, rest)
        return
    if args.lr_from is not None and args.lr_from != per:  # the pick of the same pool's tuned cell
        lr = picked_lr(cell_dir(args.out, pool, args.lr_from, method))
        fh.compare(args, folder, algorithm, ["--set", f"algorithm.lr={lr}", *rest])
        return
    start = [float(v) for v in args.grid.split(",")]
    grid = tried_grid(folder, start)
    while True:
        fh.compare(args, folder, algorithm, ["--tune", "lr=" + ",".join(f"{v:g}" for v in grid), *rest])
        grid = tuned_grid(folder)
        grown = wider(grid, picked_lr(folder))
        if grown is None:
            return
        if len(grid) - len(start) >= MAX_EXTENSIONS:  # the final run at the edge pick stays
            print(f"  {folder}: pick {picked_lr(folder):g} at the edge of {grid} after {MAX_EXTENSIONS} extensions; "
                  "kept", flush=True)
            return
        print(f"  {folder}: pick {picked_lr(folder):g} at the edge of {grid}; the grid extended to {grown}", flush=True)
        for item in folder.iterdir():  # the final run is made again at the new pick; the trials stay
            if item.name != "tune":
                shutil.rmtree(item) if item.is_dir() else item.unlink()
        grid = grown


def new_clients(folder: Path, row: dict) -> dict[str, float]:
    """held-out client id -> its accuracy as deployed (``new_clients.json``), empty without one."""
    path = folder / row["algorithm"] / "new_clients.json"
    if not path.is_file():
        return {}
    clients = json.loads(path.read_text())["new_clients"]["clients"]
    return {c: v["model.acc"] for c, v in clients.items() if v.get("model.acc") is not None}


def scores(folder: Path) -> dict[str, dict[str, float]] | None:
    """protocol -> client -> accuracy of the comparison in ``folder`` (its first row), or None unfinished."""
    result = folder / "compare.json"
    if not result.is_file():
        return None
    row = json.loads(result.read_text())["rows"][0]
    return {"model.acc": fh.per_client(folder, row, "model.acc"),
            "model@global.acc": fh.per_client(folder, row, "model@global.acc"),
            "new": new_clients(folder, row)}


#: methods whose server merges no uploads: their rows have no aggregation rule
NO_AGGREGATION = ("pretrained", "standalone")


def aggregation(folder: Path, algorithm: str) -> str:
    """The aggregation rule the comparison in ``folder`` ran under (``engine.aggregation`` of its
    ``config.yaml``), ``-`` for a method that aggregates nothing, ``unknown`` without a config."""
    if algorithm in NO_AGGREGATION:
        return "-"
    return fh.aggregation_rule(folder) if (folder / "config.yaml").is_file() else "unknown"


def summarize(out: Path, pools: list[int], per: list[int], methods: list[str]) -> dict:
    """The map's JSON: per cell, method and protocol the mean over clients and the paired gains (points,
    ``[mean, half-width, n]``) over the floor and over standalone."""
    cells = []
    for pool in pools:
        for p in per:
            got = {m: scores(cell_dir(out, pool, p, m)) for m in methods}
            entry = {"pool": pool, "per_client": p, "clients": cell_clients(pool, p),
                     "null_result": (pool, p) == NULL_CELL, "methods": {}}
            for m, s in got.items():
                if s is None:
                    continue
                folder = cell_dir(out, pool, p, m)
                row = json.loads((folder / "compare.json").read_text())["rows"][0]
                rec = {"mean": {k: (sum(v.values()) / len(v) if v else None) for k, v in s.items()},
                       "aggregation": aggregation(folder, row["algorithm"]),
                       "bn_statistics": row.get("bn_statistics", "-")}
                for ref in ("pretrained", "standalone"):
                    if m == ref or got.get(ref) is None:
                        continue
                    gains = {}
                    for key, _ in PROTOCOLS:
                        iv = paired_interval(s[key], got[ref][key])
                        gains[key] = ([100 * iv.mean, None if math.isnan(iv.half) else 100 * iv.half, iv.n]
                                      if iv.n else None)
                    rec[f"vs_{ref}"] = gains
                entry["methods"][m] = rec
            cells.append(entry)
    return {"cells": cells, "methods": methods}


def _points(g) -> str:
    """A stored gain ``[mean, half-width, n]`` (points) as :func:`format_points` writes it."""
    if not g:
        return "-"
    mean, half, n = g
    return format_points(Interval(mean / 100, float("nan"), n, half / 100 if half is not None else float("nan")))


def render(result: dict, results: Path, command: str) -> str:
    """``where_federation_pays.md`` / ``.json`` / ``.png`` in ``results``; returns the Markdown."""
    results.mkdir(parents=True, exist_ok=True)
    lines = ["# Where federation pays: the map", "", f"Command: `{command}`. One seed per cell; 10 % participation "
             "by default; balanced-dirichlet label skew; 20 % of the clients held out (new clients). Gains are paired "
             "over the clients both methods scored, in points: mean ± the 95 % Student's t half-width over the clients "
             "(t(0.975, n−1) × SE); `*` where the interval excludes 0. The (20,000, 1,500) cell is the fair headline's "
             "null result: no trained method beat the floor there.", "", "![gain per cell](where_federation_pays.png)", "",
             "| pool | images / client | clients | method | aggregation | BN statistics | personalized | global | new clients "
             "| vs floor: pers. | global | new | vs standalone: pers. | global | new |", "|" + "---|" * 15]
    for cell in result["cells"]:
        tag = " (null result)" if cell["null_result"] else ""
        for m, rec in cell["methods"].items():
            means = [f"{rec['mean'][k]:.3f}" if rec["mean"].get(k) is not None else "-" for k, _ in PROTOCOLS]
            gains = [_points((rec.get(f"vs_{ref}") or {}).get(k)) for ref in ("pretrained", "standalone")
                     for k, _ in PROTOCOLS]
            rules = [rec.get("aggregation", "-"), rec.get("bn_statistics", "-")]
            lines.append(f"| {cell['pool']:,}{tag} | {cell['per_client']} | {cell['clients']} | {m} | "
                         + " | ".join(rules + means + gains) + " |")
    text = "\n".join(lines) + "\n"
    (results / "where_federation_pays.md").write_text(text)
    (results / "where_federation_pays.json").write_text(json.dumps({**result, "command": command}, indent=2) + "\n")
    figure(results / "where_federation_pays.png", result)
    return text


def figure(path: Path, result: dict) -> None:
    """Two panels, one group of bars per cell, one bar per trained method: the gain over the floor on the
    global protocol, and over standalone on new clients (points, error bars: the t half-widths)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    shown = [m for m in result["methods"] if m not in ("pretrained", "standalone")] + ["standalone"]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(cells) + 3), 3.8), layout="constrained", sharey=False)
    for ax, (ref, key, title) in zip(axes, (("pretrained", "model@global.acc", "gain over the floor, global"),
                                            ("standalone", "new", "gain over standalone, new clients"))):
        methods = [m for m in shown if m != ref]
        width = 0.8 / max(1, len(methods))
        for j, m in enumerate(methods):
            xs, ys, es = [], [], []
            for i, cell in enumerate(cells):
                g = ((cell["methods"].get(m) or {}).get(f"vs_{ref}") or {}).get(key)
                if g:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(g[0])
                    es.append(g[1] if g[1] is not None else 0.0)
            ax.bar(xs, ys, width=width, yerr=es, capsize=2, label=m)
        ax.axhline(0, color="black", linewidth=0.8)
        labels = [f"{c['pool'] // 1000}k pool\n{c['per_client']}/client" + ("\n(null result)" if c["null_result"] else "")
                  for c in cells]
        ax.set_xticks(range(len(cells)), labels, fontsize=7)
        ax.set_ylabel("points")
        ax.set_title(title, fontsize=9)
        for i, c in enumerate(cells):
            if c["null_result"]:
                ax.axvspan(i - 0.45, i + 0.45, color="grey", alpha=0.15)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "rafl-data" / "cifar10")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "where-federation-pays")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--pools", default="5000,20000")
    ap.add_argument("--per-client", default=",".join(map(str, PER_CLIENT)))
    ap.add_argument("--methods", default="pretrained,standalone,uniform+sbn,HTFL,rafl+kw1",
                    help="HTFL stands for --htfl")
    ap.add_argument("--htfl", default="fedgh", help="the HtFL method of the map (the fair headline's best: fedgh)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", default=fh.GRID)
    ap.add_argument("--lr-from", type=int, default=None, metavar="PER_CLIENT",
                    help="tune only the cells of this images-per-client value; the other cells of the same pool run "
                         "each method once at that cell's pick (the fair headline's --tune-seeds 0, over cells)")
    ap.add_argument("--jobs", type=int, default=1, help="comparisons at once")
    ap.add_argument("--device", default="cpu", help="train.device (cuda: falls back to the CPU per job)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every rafl compare")
    ap.add_argument("--from", dest="from_dir", type=Path, default=None, help="summarize finished cells only")
    args = ap.parse_args(argv)
    args.smoke = False
    args.config = CONFIG
    pools, per, methods = check_args(args)
    command = "python bench/where_federation_pays.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.from_dir is not None:
        args.out = args.from_dir
        result = summarize(args.out, pools, per, methods)
        if not any(cell["methods"] for cell in result["cells"]):
            die(f"--from {args.from_dir}: no finished comparison of these cells and methods (a folder of "
                "pool*-pc*/METHOD/compare.json, as --out writes); nothing written")
        print(render(result, args.results, command))
        return 0
    hours = budget(pools, per, methods, args)
    print(f"budget estimate: {hours:.1f} CPU hours ({len(pools) * len(per)} cells x {len(methods)} methods, "
          f"{len(args.grid.split(','))} lr trials + the final run each, {args.rounds} rounds; "
          f"{SECONDS_PER_IMAGE_STEP} s per image-step, {SECONDS_PER_SCORING} s per scoring, measured); "
          f"about {hours / max(1, args.jobs):.1f} h wall with --jobs {args.jobs}", flush=True)
    jobs = [(pool, p, m) for pool in pools for p in per for m in methods]
    failed: list[str] = []
    start = time.time()

    def job(cell: tuple[int, int, str]) -> None:
        try:
            run_cell(args, *cell)
        except SystemExit as err:
            failed.append(str(err))
            print(err, flush=True)

    # with --lr-from the tuned cells first: the other cells read their picks
    phases = ([[j for j in jobs if j[1] == args.lr_from], [j for j in jobs if j[1] != args.lr_from]]
              if args.lr_from is not None else [jobs])
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        try:
            for phase in phases:
                list(pool.map(job, phase))
        except KeyboardInterrupt:  # as bench/fair_headline.py: the comparisons got the same SIGINT and stop
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            fh.STOPPING = True
            print("interrupted: every unfinished comparison resumes with the same command", flush=True)
            pool.shutdown(wait=True, cancel_futures=True)
            return 130
    print(render(summarize(args.out, pools, per, methods), args.results, command))
    print(f"{len(jobs) - len(failed)} of {len(jobs)} comparisons finished in {(time.time() - start) / 3600:.1f} h",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
