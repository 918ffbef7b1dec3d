"""The prototype family's uploads from the training pass: ``class_means: last_epoch`` vs ``eval_pass``.

FedProto, FedTGP and FD upload per-class means (prototypes of the representation, or FD's mean
logits). ``eval_pass`` computes them with one more no-grad pass over the client's training data in
eval mode after local training (FedProto's Eq. 4 taken literally); ``last_epoch`` keeps the
forward passes of the last local epoch, which training runs anyway (train-mode BN, the weights
moving between batches: what the official FedProto code and HtFLlib's FedProto / FD clients do).

For each method and seed the two runs go back to back on the scenarios of ``bench/htfl_bench.py``
(same partitions, htfe-tiny models, settings and seeds; every client every round, one local epoch,
one torch thread, ``engine.workers: 1``): the head's and the nearest prototype's accuracy (mean of the last ``--tail``
rounds, paired per seed), and the client steps' seconds per round (the engine's
``time_client_update_s``, mean over rounds: local training + the upload's means, the part the
option changes) with the ratio last_epoch / eval_pass per seed. On a loaded machine whole runs
drift; ``--steps N`` times the client step alone instead: one client's ``client_update`` in the
two modes alternately, N times each, in one process (median seconds and their ratio).

Run: ``nice -n 10 python bench/class_means.py --only digits-pat2-train20 --rounds 8 --seeds 0,1 --tail 3 --out DIR``;
writes ``bench/results/class_means[_<only>][_rounds<R>][_limit<N>].md`` and ``.json``. Runs are cached
per method, mode and seed under ``DIR`` like ``htfl_bench.py``'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from rafl.federation.run_config import load_run_config
from rafl.federation.runners import client_context
from rafl.reports.compare import read_history
from rafl.stages.compare import load_compare_config
from rafl.stages.prepare import prepare

import htfl_bench as hb

METHODS = ("fedproto", "fd", "fedtgp")
MODES = ("eval_pass", "last_epoch")


def seed_runs(name: str, overrides: list[str], out: Path, rounds: int, dim: int, seed: int, tail: int, device: str,
              methods: list[str]) -> dict:
    """Every method in both modes on one partition/seed: accuracies and client-step seconds per round."""
    torch.set_num_threads(1)
    sets = hb._method_sets(overrides, rounds, seed, device)
    cfg, _ = load_compare_config(None, sets, ["standalone"])
    held = hb.client_classes(cfg, dim)
    rows: dict[str, dict] = {}
    for method in methods:
        for mode in MODES:
            vsets = sets + ["engine.workers=1", f"algorithm.{method}.class_means={mode}"]
            vcfg, vhps = load_compare_config(None, vsets, [method])
            tag = f"{method}-{mode}"
            row = hb.cached_method(name, method, vsets, vcfg, vhps[method], held, out, dim, seed, tail, tag=tag)["row"]
            hist = read_history(out / name / f"seed{seed}" / tag / method)
            steps = [h["time_client_update_s"] for h in hist if "time_client_update_s" in h]
            rows[tag] = {"model": row.get("model.acc_tail"), "proto": row.get("proto.acc_tail"),
                         "client_s_per_round": statistics.fmean(steps) if steps else None,
                         "diverged": row.get("diverged")}
    return {"seed": seed, "rows": rows}


def _seed_runs_star(args: tuple) -> dict:
    return seed_runs(*args)


def summarize(name: str, runs: list[dict], methods: list[str]) -> dict:
    table = []
    for method in methods:
        a, b = (f"{method}-{m}" for m in MODES)
        done = [r for r in runs if not r["rows"][a]["diverged"] and not r["rows"][b]["diverged"]]
        entry = {"method": method, "seeds": [r["seed"] for r in done]}
        for rule in ("model", "proto"):
            if done and done[0]["rows"][a][rule] is not None:
                exact = [r["rows"][a][rule] for r in done]
                fast = [r["rows"][b][rule] for r in done]
                entry[rule] = {"eval_pass": statistics.fmean(exact), "last_epoch": statistics.fmean(fast),
                               "diff_points": [100 * (f - e) for e, f in zip(exact, fast)]}
        ratios = [r["rows"][b]["client_s_per_round"] / r["rows"][a]["client_s_per_round"] for r in done]
        entry["client_s_per_round"] = {m: statistics.fmean(r["rows"][f"{method}-{m}"]["client_s_per_round"]
                                                           for r in done) for m in MODES}
        entry["ratio_per_seed"] = ratios
        entry["ratio"] = statistics.fmean(ratios) if ratios else None
        table.append(entry)
    return {"scenario": name, "table": table}


def report(results: list[dict], args, argv: list[str]) -> str:
    lines = ["# Class means from the training pass (`python bench/class_means.py " + " ".join(argv) + "`)", "",
             f"The settings of `bench/htfl_bench.py` ({args.rounds} rounds, htfe-tiny, D = {args.feature_dim}, one "
             f"local epoch, seeds {', '.join(map(str, args.seeds))}; accuracy = mean over clients, mean of the last "
             f"{args.tail} rounds). Each method with `class_means: eval_pass` (one more pass in eval mode) and "
             "`last_epoch` (the last local epoch's training passes), back to back per seed. **client s / round** = "
             "the engine's `time_client_update_s` (local training and the upload's means of every client), mean over "
             "rounds and seeds; **ratio** = last_epoch / eval_pass, mean of the per-seed ratios. Differences are "
             "last_epoch - eval_pass in points, paired per seed.", ""]
    for res in results:
        lines += [f"## {res['scenario']}", "",
                  "| method | acc eval_pass | acc last_epoch | diff per seed (points) | proto eval_pass | "
                  "proto last_epoch | diff per seed (points) | client s / round eval_pass | last_epoch | ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for t in res["table"]:
            cells = [t["method"]]
            for rule in ("model", "proto"):
                if rule in t:
                    r = t[rule]
                    cells += [f"{r['eval_pass']:.4f}", f"{r['last_epoch']:.4f}",
                              ", ".join(f"{d:+.2f}" for d in r["diff_points"])]
                else:
                    cells += ["-", "-", "-"]
            s = t["client_s_per_round"]
            cells += [f"{s['eval_pass']:.2f}", f"{s['last_epoch']:.2f}",
                      f"{t['ratio']:.3f} ({', '.join(f'{x:.3f}' for x in t['ratio_per_seed'])})"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def time_steps(name: str, overrides: list[str], dim: int, device: str, methods: list[str], repeats: int) -> list[dict]:
    """Median seconds of one client's ``client_update`` (client 0 of seed 0's partition, round 2:
    with a broadcast of global vectors) per method and mode, the two modes alternating."""
    torch.set_num_threads(1)
    rows = []
    for method in methods:
        sets = hb._method_sets(overrides, 2, 0, device) + ["engine.workers=1", f"algorithm.name={method}",
                                                            "clients.models=" + hb.MODELS,
                                                            f"clients.feature_dim={dim}"]
        if method == "fedtgp":
            sets.append("algorithm.server_epochs=1")
        fed = prepare(load_run_config(None, sets), progress=False).federation
        algos = {m: type(fed.algorithm)(**{**fed.algorithm.hparams, "class_means": m}) for m in MODES}
        ctx = client_context(fed, 0, 0, 1)
        state = fed.algorithm.init_client(ctx)
        server_state, broadcast = fed.algorithm.init_server(fed.server)
        _, up = fed.algorithm.client_update(state, broadcast, ctx)  # round 1, to get a broadcast of global vectors
        up.meta.update({"client_id": 0, "n_samples": fed.clients[0].n_samples})
        _, broadcast = fed.algorithm.server_aggregate([up], server_state, fed.server)
        secs: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(repeats):
            for m in MODES:
                ctx = client_context(fed, 0, 0, 2)
                torch.manual_seed(ctx.seed)
                t0 = time.perf_counter()
                algos[m].client_update(state, broadcast, ctx)
                secs[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(v) for m, v in secs.items()}
        rows.append({"method": method, "median_s": med, "ratio": med["last_epoch"] / med["eval_pass"],
                     "train_samples": fed.clients[0].n_samples, "repeats": repeats})
        print(f"  {method}: eval_pass {med['eval_pass']:.4f}s  last_epoch {med['last_epoch']:.4f}s  "
              f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hb.add_common_args(ap)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list among fedproto, fd, fedtgp")
    ap.add_argument("--steps", type=int, default=0, help="time N client steps per mode instead of whole runs")
    args = ap.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    scenarios, only = hb.selected(ap, args)
    if args.steps:
        lines = ["# Client step, class_means: last_epoch vs eval_pass (`python bench/class_means.py "
                 + " ".join(argv) + "`)", "",
                 "One client's `client_update` (client 0 of seed 0's partition, round 2, htfe-tiny, one local epoch, "
                 f"batch 10, one torch thread) in the two modes alternately, {args.steps} times each; median seconds.",
                 ""]
        results = []
        for name, sets in scenarios.items():
            print(f"== {name}", flush=True)
            rows = time_steps(name, sets, args.feature_dim, args.device, methods, args.steps)
            results.append({"scenario": name, "steps": rows})
            lines += [f"## {name} (client 0: {rows[0]['train_samples']} training samples)", "",
                      "| method | eval_pass s | last_epoch s | ratio |", "|---|---|---|---|"]
            lines += [f"| {r['method']} | {r['median_s']['eval_pass']:.4f} | {r['median_s']['last_epoch']:.4f} | "
                      f"{r['ratio']:.3f} |" for r in rows] + [""]
        text = "\n".join(lines) + "\n"
        print(text)
        hb.write_results("class_means_steps", only, args, text, results)
        return 0
    results = []
    for name, sets in scenarios.items():
        print(f"== {name}", flush=True)
        work = [(name, sets, args.out, args.rounds, args.feature_dim, s, args.tail, args.device, methods)
                for s in args.seeds]
        t0 = time.perf_counter()
        runs = hb.map_seeds(_seed_runs_star, work, args.jobs)
        results.append(summarize(name, runs, methods) | {"elapsed_s": time.perf_counter() - t0})
    text = report(results, args, argv)
    print(text)
    hb.write_results("class_means", only, args, text, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
