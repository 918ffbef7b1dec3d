"""Flower backend bench: what running the clients on Flower costs, and that it computes the same run.

One run config -- by default the ``rafl federate`` default pipeline (digits, 10 clients with
profiles pi4 / jetson-nano / phone, Dirichlet 0.5, the quickstart supernet, one searched subnet per
profile) with ``--algorithm`` for ``--rounds`` rounds -- is run three ways, side by side in this
process's session:

1. **in-process**: ``federate.prepare`` + ``federate.run`` (the engine's default runner) with
   ``engine.workers`` = ``--nodes`` (the same parallelism as the deployment);
2. **Flower simulation**: the same with ``engine.backend: flower`` (Flower's Simulation Runtime,
   Ray, one virtual SuperNode per client);
3. **Flower deployment**: ``rafl flower-app`` + ``flwr run`` against a SuperLink and ``--nodes``
   SuperNodes on 127.0.0.1 (:class:`rafl.stages.flower.fleet.LocalFleet`); each round sends one
   train and one evaluate message per node (carrying all its clients). Once per ``--deployments``
   entry ``ISOLATION:POLL``, back to back. ``ISOLATION``: ``fork`` (rafl's default: each SuperNode
   with ``--isolation process`` beside ``rafl flower-superexec``, which forks each message's
   ClientApp from one warm process holding torch and the run's federation) or ``subprocess``
   (Flower's own SuperExec: each message starts a ``flwr-clientapp`` process, which imports torch
   and rebuilds the federation from the run config). ``POLL``: the SuperNodes run as ``rafl
   flower-supernode --poll-interval POLL`` (LocalFleet's default, 0.2 s) or, for ``flower``, as
   Flower's own ``flower-supernode`` (3 s between an idle node's requests). Default:
   ``fork:0.2,fork:flower,subprocess:flower``.

``--case tiny``: 1,000 clients with the tiny heterogeneous CNNs (``htfe-tiny``) on CIFAR-10, IID,
FedProto, 20 clients sampled per round and evaluated (``eval_clients: sampled``): the per-message
cost against little work per client.

Printed per backend: wall seconds of the whole run (preparation included; deployment: the
``flwr run`` command), mean seconds per round (from ``metrics.jsonl``; also without round 1,
where a node builds the run's federation), the ratios to in-process, and whether every metric
except the timings equals the in-process run's (it must: same seeds, same client steps).

Run: ``python bench/flower_overhead.py [--rounds 3] [--algorithm rafl] [--nodes 2]`` (writes
``bench/results/flower_overhead.md`` and ``.json``); ``python bench/flower_overhead.py --case tiny
--data-root ~/.cache/rafl-data/cifar10`` (``flower_overhead_tiny.*``). A few minutes each on 2 cores.
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
    """The rows without what differs by backend on purpose: timings, and the bytes the Flower
    messages moved (``wire_*``, ``cum_wire_mb``: traffic as sent, which in-process has none of)."""
    return [{k: v for k, v in r.items() if not k.startswith(("time", "wire_", "cum_wire"))} for r in rs]


#: the 1,000-tiny-client case (``--case tiny``): run-config overrides
TINY = ["data.dataset=cifar10", "clients.n=1000", "clients.models=htfe-tiny", "partition.scheme=iid",
        "algorithm.name=fedproto", "engine.clients_per_round=20", "engine.eval_clients=sampled",
        "train.batch_size=10"]


def nested(overrides: list[str]) -> dict:
    """``a.b=v`` overrides as a nested YAML mapping (values parsed as YAML scalars)."""
    out: dict = {}
    for item in overrides:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--algorithm", default=None, help="default: rafl (--case default), fedproto (--case tiny)")
    ap.add_argument("--nodes", type=int, default=2, help="SuperNodes of the local deployment")
    ap.add_argument("--case", choices=("default", "tiny"), default="default")
    ap.add_argument("--data-root", type=Path, default=None, help="CIFAR-10 (--case tiny)")
    ap.add_argument("--deployments", default="fork:0.2,fork:flower,subprocess:flower",
                    help="deployments to run, comma-separated ISOLATION:POLL (POLL: the SuperNodes' idle poll in "
                         "seconds, `rafl flower-supernode --poll-interval`, or `flower`: Flower's own "
                         "flower-supernode, 3 s)")
    ap.add_argument("--no-simulation", action="store_true", help="leave out the Simulation Runtime")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate
    from rafl.stages.flower import app as flower_app
    from rafl.stages.flower import fleet as flower_fleet

    base_overrides = [*(TINY if args.case == "tiny" else []), f"engine.rounds={args.rounds}"]
    if args.algorithm:
        base_overrides.append(f"algorithm.name={args.algorithm}")
    if args.data_root:
        base_overrides.append(f"data.root={args.data_root.expanduser().resolve()}")
        # the nodes' trust boundary: a message may name only data under the node's own data roots
        os.environ["RAFL_FLOWER_DATA_ROOTS"] = str(args.data_root.expanduser().resolve())
    algorithm = args.algorithm or ("fedproto" if args.case == "tiny" else "rafl")
    work = Path(tempfile.mkdtemp(prefix="rafl-flower-bench-"))
    os.environ["FLWR_HOME"] = str(work / "flwr-home-sim")
    cfg = load_run_config(None, base_overrides)
    federate.prepare(cfg, progress=False)  # warm the supernet and search caches: every backend reads them

    results: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        run_dir = fn()
        wall = time.perf_counter() - t0
        rs = rows(run_dir)
        later = [r["time_s"] for r in rs[1:]] or [rs[0]["time_s"]]
        results[name] = {"wall_s": wall, "round_s": sum(r["time_s"] for r in rs) / len(rs),
                         "round_s_after_1": sum(later) / len(later),
                         "final_acc": rs[-1].get("model.acc_mean_over_clients"), "rows": no_time(rs)}
        print(f"{name}: {wall:.1f} s, {results[name]['round_s']:.2f} s/round", flush=True)

    def in_process() -> Path:
        # as many worker processes as the deployment has SuperNodes: the same parallelism (the
        # default, engine.workers: null, follows the load average, which a benchmark just run raises)
        c = load_run_config(None, [*base_overrides, "name=inproc", f"engine.workers={args.nodes}"])
        federate.run(federate.prepare(c, progress=False), work / "runs" / "inproc", progress=False)
        return work / "runs" / "inproc"

    def simulation() -> Path:
        c = load_run_config(None, [*base_overrides, "name=sim", "engine.backend=flower"])
        federate.run(federate.prepare(c, progress=False), work / "runs" / "sim", progress=False)
        return work / "runs" / "sim"

    def deployment(isolation: str, poll: float | None):
        def go() -> Path:
            tag = f"{isolation}-{'flower' if poll is None else poll}"
            name = f"deployed-{tag}"
            cfg_file = work / f"{name}.yaml"
            cfg_file.write_text(yaml.safe_dump({**nested(base_overrides), "name": name}))
            flower_app.write_app(work / f"app-{tag}", config=cfg_file, out=work / "runs")
            with flower_fleet.LocalFleet(args.nodes, work / f"fleet-{tag}", isolation=isolation,
                                         poll_interval_s=poll) as fleet:
                run = fleet.run(work / f"app-{tag}", timeout=3600)
                if not run.completed:
                    sys.exit(f"the deployment failed ({run.status}: {run.status_details}):\n{run.stdout}\n"
                             f"{run.stderr}\n{fleet.logs()[-5000:]}")
            return work / "runs" / name
        return go

    timed("in-process", in_process)
    if args.case == "default" and not args.no_simulation:
        timed("flower simulation", simulation)
    for item in args.deployments.split(","):
        isolation, _, poll_text = item.partition(":")
        poll = None if poll_text in ("", "flower") else float(poll_text)
        node = "flower-supernode (3 s poll)" if poll is None else f"rafl flower-supernode --poll-interval {poll:g}"
        timed(f"flower deployment, {isolation}, {node} ({args.nodes} SuperNodes)", deployment(isolation, poll))

    base = results["in-process"]
    command = (f"python bench/flower_overhead.py --case {args.case} --rounds {args.rounds} --nodes {args.nodes}"
               + (f" --algorithm {args.algorithm}" if args.algorithm else "")
               + (" --data-root DATA" if args.data_root else "")
               + (f" --deployments {args.deployments}" if args.deployments != ap.get_default("deployments") else "")
               + (" --no-simulation" if args.no_simulation else ""))
    setting = ("The `rafl federate` default pipeline (digits, 10 clients, quickstart supernet)"
               if args.case == "default" else
               "1,000 clients, `htfe-tiny` models, CIFAR-10 IID, 20 clients sampled and evaluated per round")
    lines = [
        "# Flower backend: cost and equality vs the in-process engine",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, load average before "
        f"{os.getloadavg()[0]:.1f}). {setting}, {algorithm}, {args.rounds} rounds; supernet and search caches warm. "
        "Backends run one after the other in this process's session.",
        "",
        "| backend | wall s (run) | s / round | s / round after round 1 | ratio to in-process (s / round) | "
        "ratio after round 1 | final acc (mean over clients) | metrics equal to in-process |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        same = r["rows"] == base["rows"]
        r["equal_to_in_process"] = same
        r["ratio_wall"] = r["wall_s"] / base["wall_s"]
        r["ratio_round"] = r["round_s"] / base["round_s"]
        r["ratio_round_after_1"] = r["round_s_after_1"] / base["round_s_after_1"]
        acc = r["final_acc"]
        lines.append(f"| {name} | {r['wall_s']:.1f} | {r['round_s']:.2f} | {r['round_s_after_1']:.2f} | "
                     f"{r['ratio_round']:.2f}x | {r['ratio_round_after_1']:.2f}x | "
                     f"{'-' if acc is None else f'{acc:.4f}'} | {'yes' if same else 'NO'} |")
    target = 1.3 if args.case == "default" else 3.0
    lines += ["", f"Target (issue 32): deployment s/round <= {target}x in-process.",
              "Metrics compared: every column of `metrics.jsonl` except the `time*` columns and the Flower "
              "backends' own `wire_*` / `cum_wire_mb` (the bytes their messages moved), every round: accuracies, "
              "payload bytes up/down, failures.",
              "In-process runs `engine.workers` = the SuperNodes (the same parallelism). Deployment: a warm query "
              "before round 1 has each node's SuperExec build the run's federation (`warm_nodes`); per round one "
              "train and one evaluate message per node, each carrying all the node's clients. `fork`: "
              "`rafl flower-superexec` forks each message's ClientApp from a process that imported torch, flwr "
              "and rafl once and built the run's federation once (when the warm query reported it); "
              "`subprocess`: Flower's SuperExec starts a new `flwr-clientapp` "
              "process per message, which imports torch and rebuilds the federation. `flower-supernode (3 s poll)`: "
              "Flower's own SuperNode, which asks the SuperLink for a message every 3 s when idle and checks for a "
              "ClientApp's reply every 0.5 s; `rafl flower-supernode --poll-interval S`: the same SuperNode sleeping "
              "at most S seconds in both waits (`rafl.stages.flower.supernode`)."]
    text = "\n".join(lines) + "\n"
    print(text)
    tag = "flower_overhead" + ("" if args.case == "default" else f"_{args.case}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{tag}.md").write_text(text)
    (args.out / f"{tag}.json").write_text(json.dumps(
        {k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()}, indent=2) + "\n")
    if not all(r["equal_to_in_process"] for r in results.values()):
        sys.exit("FAIL: a Flower backend computed other numbers than the in-process engine")


if __name__ == "__main__":
    main()
