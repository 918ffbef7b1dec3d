"""Weight sharing vs knowledge transfer: HeteroFL, FedRolex, uniform vs RaFL, FedGH, FedTGP, FedProto, Standalone.

Scenario (issue 30, "Measured"): ``--clients`` (20) clients over the device profiles pi4 /
jetson-nano / phone (round-robin), Dirichlet(``--alpha`` 0.5) label skew, one searched subnet per
profile (``clients.models: nas``), the same partition and seeds for every method. Reported per
method, as mean +- std over seeds: the deployed model's final-round accuracy on each client's own
test split, overall (mean over clients) and per device tier (mean over that tier's clients), and
the bytes up / down per round (the engine's serialized payload sizes).

The federated supernet: after each seed's ``heterofl`` run, the server's global model (saved as
``RUN_DIR/supernet.safetensors``) is searched again with the same search config
(``supernet.path: RUN_DIR``), and the subnets found *before* (on the pretrained supernet) and
*after* federation are compared on the clients' test splits, both cut from their own supernet and
BN-recalibrated on the server's public pool, with no local training (``before`` / ``after``
columns, overall and per tier, and the paired per-seed difference).

Run (digits, the quickstart supernet; a few minutes)::

    python bench/weight_sharing.py --dataset digits --rounds 3 --seeds 0,1,2 --out runs/ws-digits

CIFAR-10 with the pretrained supernet (the issue's scenario; on a GPU add ``--device cuda``)::

    python bench/weight_sharing.py --dataset cifar10 --data-root ~/.cache/rafl-data/cifar10 \
        --supernet /work/main/runs/cifar10-supernet --public-fraction 0.5 --rounds 30 --seeds 0,1,2 \
        --out runs/ws-cifar10

Writes ``bench/results/weight_sharing_<dataset>.md`` and ``.json`` (``--tag`` is appended to the
name) and prints one line per method and seed. Finished runs are kept under ``--out`` (one run dir
per seed and method, with its ``summary.json``) and are not rerun.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from rafl.federation.build import client_loaders
from rafl.federation.run_config import load_run_config
from rafl.federation.training import evaluate_accuracy
from rafl.io import atomic_write_json, atomic_write_text
from rafl.stages.federate import prepare, run

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["heterofl", "fedrolex", "uniform", "rafl", "fedgh", "fedtgp", "fedproto", "standalone"]
PROFILES = ["pi4", "jetson-nano", "phone"]


def overrides(args, seed: int, method: str) -> list[str]:
    sets = [f"seed={seed}", f"partition.seed={seed}", f"data.dataset={args.dataset}", f"clients.n={args.clients}",
            f"clients.profiles=[{', '.join(PROFILES)}]", "partition.scheme=dirichlet", f"partition.alpha={args.alpha}",
            f"partition.min_samples={args.min_samples}", f"algorithm.name={method}", f"engine.rounds={args.rounds}",
            f"algorithm.local_epochs={args.local_epochs}", f"train.device={args.device}", "engine.target_accuracy=null",
            f"search.population={args.population}", f"search.generations={args.generations}"]
    if args.data_root:
        sets.append(f"data.root={args.data_root}")
    if args.supernet:
        sets.append(f"supernet.path={args.supernet}")
    if args.public_fraction is not None:
        sets.append(f"partition.public_fraction={args.public_fraction}")
    if args.limit_per_class:
        sets.append(f"data.limit_per_class={args.limit_per_class}")
    if args.dataset != "digits":  # the default budget overrides are sized for the quickstart's 12-16 px
        sets.append("clients.budgets={}")
    return sets


def tiers(table: list[dict], per_client: dict[str, dict]) -> dict[str, float]:
    """Mean accuracy over all clients and per device profile, from a run's per-client ``model.acc``."""
    acc = {row["client"]: per_client.get(str(row["client"]), {}).get("model.acc") for row in table}
    out = {"overall": float(np.mean([a for a in acc.values() if a is not None]))}
    for prof in PROFILES:
        vals = [acc[r["client"]] for r in table if r["profile"] == prof and acc[r["client"]] is not None]
        if vals:
            out[prof] = float(np.mean(vals))
    return out


def run_method(args, seed: int, method: str, out: Path) -> dict:
    run_dir = out / f"seed{seed}" / method
    done = run_dir / "bench.json"
    if done.is_file():
        return json.loads(done.read_text())
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # an interrupted run: start it again
    cfg = load_run_config(None, overrides(args, seed, method))
    t0 = time.perf_counter()
    prep = prepare(cfg, progress=False)
    summary = run(prep, run_dir, progress=False)
    history = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rec = {"method": method, "seed": seed, "acc": tiers(prep.clients_table, summary["clients"]),
           "mb_up_per_round": float(np.mean([h["bytes_up"] for h in history])) / 1e6,
           "mb_down_per_round": float(np.mean([h["bytes_down"] for h in history])) / 1e6,
           "archs": sorted({r["arch"] for r in prep.clients_table}), "wall_s": time.perf_counter() - t0}
    if method == "heterofl":
        rec["federated_supernet"] = federated_search(args, seed, prep, run_dir)
    atomic_write_json(done, rec)
    return rec


def _test_accuracy(prep) -> dict[str, float]:
    """Each client's own subnet (as the federation built it: cut from its supernet, BN recalibrated
    on the public pool; no local training) on its test split, as tiers."""
    fed = prep.federation
    loaders = client_loaders(*_data(prep), prep.cfg.train.batch_size)
    per = {}
    for cid in range(len(fed.clients)):
        model = fed.client_model(cid).eval()
        correct, total = evaluate_accuracy(model, loaders(cid, "test", 0), device=fed.device)
        per[str(cid)] = {"model.acc": correct / total if total else None}
    return tiers(prep.clients_table, per)


def _data(prep):
    from rafl.stages.prepare import load_data_and_partition

    ds, part = load_data_and_partition(prep.cfg, progress=False)
    return ds, part


def federated_search(args, seed: int, prep, run_dir: Path) -> dict:
    """Search the federated supernet in ``run_dir`` again; the subnets before vs after on the clients' tests."""
    before = _test_accuracy(prep)
    sets = [s for s in overrides(args, seed, "standalone") if not s.startswith("supernet.path=")]
    after_prep = prepare(load_run_config(None, [*sets, f"supernet.path={run_dir}"]), progress=False)
    after = _test_accuracy(after_prep)
    return {"before": before, "after": after,
            "archs_before": {p: v["arch"] for p, v in prep.extra["profiles"].items()},
            "archs_after": {p: v["arch"] for p, v in after_prep.extra["profiles"].items()}}


def _ms(vals: list[float]) -> str:
    if not vals:
        return "-"
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.mean(vals):.4f} +- {sd:.4f}"


def report(args, records: list[dict]) -> str:
    seeds = sorted({r["seed"] for r in records})
    lines = [f"# Weight sharing bench: {args.dataset}, {args.clients} clients over {', '.join(PROFILES)}, "
             f"Dirichlet {args.alpha}", "",
             f"`python bench/weight_sharing.py {' '.join(args.argv)}`", "",
             f"{args.rounds} rounds, {args.local_epochs} local epochs, seeds {seeds}; final-round accuracy of the "
             "deployed model on each client's own test split, mean +- std over seeds (of the mean over clients).", "",
             "| method | overall | " + " | ".join(PROFILES) + " | MB up / round | MB down / round | subnets |",
             "|---|---|" + "---|" * len(PROFILES) + "---|---|---|"]
    for m in args.methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        cells = [_ms([r["acc"]["overall"] for r in rs])] + [_ms([r["acc"][p] for r in rs if p in r["acc"]])
                                                           for p in PROFILES]
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {_ms([r['mb_up_per_round'] for r in rs])} | "
                     f"{_ms([r['mb_down_per_round'] for r in rs])} | {len(rs[0]['archs'])} |")
    fs = [r["federated_supernet"] for r in records if r["method"] == "heterofl" and "federated_supernet" in r]
    if fs:
        lines += ["", "## The federated supernet (heterofl's final global model, searched again)", "",
                  "Subnets found on the pretrained supernet (before) and on the federated one (after), each cut from "
                  "its supernet and BN-recalibrated on the public pool, no local training; clients' test splits.", "",
                  "| | overall | " + " | ".join(PROFILES) + " |", "|---|---|" + "---|" * len(PROFILES)]
        for which in ("before", "after"):
            lines.append(f"| {which} | " + " | ".join([_ms([f[which]["overall"] for f in fs])] +
                                                      [_ms([f[which][p] for f in fs]) for p in PROFILES]) + " |")
        diffs = [f["after"]["overall"] - f["before"]["overall"] for f in fs]
        wins = sum(d > 0 for d in diffs)
        lines += ["", f"after - before (overall, paired per seed): {', '.join(f'{d:+.4f}' for d in diffs)}; "
                      f"after is higher on {wins}/{len(diffs)} seeds.", ""]
        for f, r in zip(fs, [r for r in records if r["method"] == "heterofl"]):
            lines.append(f"- seed {r['seed']}: before {json.dumps(f['archs_before'])}; "
                         f"after {json.dumps(f['archs_after'])}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="digits")
    p.add_argument("--data-root", default=None)
    p.add_argument("--supernet", default=None, help="a `rafl supernet train` folder (default: the quickstart one)")
    p.add_argument("--public-fraction", type=float, default=None, help="the supernet's public pool fraction")
    p.add_argument("--limit-per-class", type=int, default=None)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--min-samples", type=int, default=10)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--population", type=int, default=24)
    p.add_argument("--generations", type=int, default=10)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    torch.set_num_threads(args.threads)
    records = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for m in args.methods:
            rec = run_method(args, seed, m, args.out)
            records.append(rec)
            extra = ""
            if "federated_supernet" in rec:
                f = rec["federated_supernet"]
                extra = f"  supernet search before {f['before']['overall']:.4f} after {f['after']['overall']:.4f}"
            print(f"seed {seed} {m:10s} acc {rec['acc']['overall']:.4f}  up {rec['mb_up_per_round']:.3f} MB/round  "
                  f"down {rec['mb_down_per_round']:.3f} MB/round  ({rec['wall_s']:.0f} s){extra}", flush=True)
    name = f"weight_sharing_{args.dataset}{('_' + args.tag) if args.tag else ''}"
    res = ROOT / "bench" / "results"
    settings = {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)}
    atomic_write_json(res / f"{name}.json", {"args": settings, "records": records})
    atomic_write_text(res / f"{name}.md", report(args, records))
    print(f"wrote {res / name}.md")


if __name__ == "__main__":
    main()
