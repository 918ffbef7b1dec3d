"""Flower backend bench: what running the clients on Flower costs, and that it computes the same run.

One run config -- by default the ``rafl federate`` default pipeline (digits, 10 clients with
profiles pi4 / jetson-nano / phone, Dirichlet 0.5, the quickstart supernet, one searched subnet per
profile) with ``--algorithm`` for ``--rounds`` rounds -- is run three ways, side by side in this
process's session:

1. **in-process**: ``pipeline.prepare`` + ``pipeline.run`` (the engine's default runner);
2. **Flower simulation**: the same with ``engine.backend: flower`` (Flower's Simulation Runtime,
   Ray, one virtual SuperNode per client);
3. **Flower deployment**: ``rafl flower-app`` + ``flwr run`` against a SuperLink and ``--nodes``
   SuperNodes on 127.0.0.1 (:class:`rafl.federation.flower.LocalFleet`); each round sends one
   train and one evaluate message per node (carrying all its clients), and each message starts a
   ``flwr-clientapp`` process (Flower's subprocess isolation), which imports torch and rebuilds the
   federation from the run config (data, partition, cached supernet and search).

Printed per backend: wall seconds of the whole run (preparation included; deployment: the
``flwr run`` command), mean seconds per round (from ``metrics.jsonl``), the ratio to in-process,
and whether every metric except the timings equals the in-process run's (it must: same seeds,
same client steps).

Run: ``python bench/flower_overhead.py [--rounds 3] [--algorithm rafl] [--nodes 2]``; writes
``bench/results/flower_overhead.md`` and ``.json`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import yaml


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def no_time(rs: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default="rafl")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNodes of the local deployment")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    from rafl.federation.run_config import load_run_config
    from rafl.federation import flower, pipeline

    work = Path(tempfile.mkdtemp(prefix="rafl-flower-bench-"))
    os.environ["FLWR_HOME"] = str(work / "flwr-home-sim")
    overrides = [f"engine.rounds={args.rounds}", f"algorithm.name={args.algorithm}"]
    cfg = load_run_config(None, overrides)
    pipeline.prepare(cfg, progress=False)  # warm the supernet and search caches: every backend reads them

    results: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        run_dir = fn()
        wall = time.perf_counter() - t0
        rs = rows(run_dir)
        results[name] = {"wall_s": wall, "round_s": sum(r["time_s"] for r in rs) / len(rs),
                         "final_acc": rs[-1].get("model.acc_mean_over_clients"), "rows": no_time(rs)}
        print(f"{name}: {wall:.1f} s, {results[name]['round_s']:.2f} s/round", flush=True)

    def in_process() -> Path:
        c = load_run_config(None, [*overrides, "name=inproc"])
        pipeline.run(pipeline.prepare(c, progress=False), work / "runs" / "inproc", progress=False)
        return work / "runs" / "inproc"

    def simulation() -> Path:
        c = load_run_config(None, [*overrides, "name=sim", "engine.backend=flower"])
        pipeline.run(pipeline.prepare(c, progress=False), work / "runs" / "sim", progress=False)
        return work / "runs" / "sim"

    def deployment() -> Path:
        cfg_file = work / "run.yaml"
        cfg_file.write_text(yaml.safe_dump({"name": "deployed", "engine": {"rounds": args.rounds},
                                            "algorithm": {"name": args.algorithm}}))
        flower.write_app(work / "app", config=cfg_file, out=work / "runs")
        with flower.LocalFleet(args.nodes, work / "fleet") as fleet:
            run = fleet.run(work / "app", timeout=3600)
            if not run.completed:
                sys.exit(f"the deployment failed ({run.status}: {run.status_details}):\n{run.stdout}\n{run.stderr}\n"
                         f"{fleet.logs()[-5000:]}")
        return work / "runs" / "deployed"

    timed("in-process", in_process)
    timed("flower simulation", simulation)
    timed(f"flower deployment ({args.nodes} SuperNodes)", deployment)

    base = results["in-process"]
    lines = [
        "# Flower backend: cost and equality vs the in-process engine",
        "",
        f"`python bench/flower_overhead.py --rounds {args.rounds} --algorithm {args.algorithm} --nodes {args.nodes}` "
        f"({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}). The `rafl federate` default pipeline (digits, 10 clients, "
        f"quickstart supernet), {args.algorithm}, {args.rounds} rounds; supernet and search caches warm.",
        "",
        "| backend | wall s (run) | s / round | ratio to in-process (wall) | final acc (mean over clients) | "
        "metrics equal to in-process |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        same = r["rows"] == base["rows"]
        r["equal_to_in_process"] = same
        r["ratio_wall"] = r["wall_s"] / base["wall_s"]
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['round_s']:.2f} | {r['ratio_wall']:.2f}x | "
                     f"{r['final_acc']:.4f} | {'yes' if same else 'NO'} |")
    lines += ["", "Metrics compared: every column of `metrics.jsonl` except the `time*` columns (accuracies, "
              "bytes up/down, failures), every round.",
              "Deployment: per round one train and one evaluate message per node, each carrying all the "
              "node's clients; each message starts a `flwr-clientapp` process that imports torch and rebuilds "
              "the federation from the run config (~6 s here), most of a round's time on this small model.",
              "History (same command, same machine): 28.43x with one message per client and one Flower array "
              "per tensor (rafl: 231 tensors per knowledge network, each moved as its own object through the SuperLink); 16.50x "
              "with one message per node. Now: one array per payload (its safetensors blob)."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flower_overhead.md").write_text(text)
    (args.out / "flower_overhead.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()}, indent=2) + "\n")
    if not all(r["equal_to_in_process"] for r in results.values()):
        sys.exit("FAIL: a Flower backend computed other numbers than the in-process engine")


if __name__ == "__main__":
    main()
