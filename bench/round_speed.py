"""Round speed: rafl's FedProto rounds (``engine.workers`` 1 and 2) against a bare PyTorch loop
doing the same client steps one after another in one process, and the 3,000-client evaluation
round with the untrained clients evaluated one by one vs. together (one evaluation per model).

Scenario (issue 35): a CIFAR-10 subset (``--limit-per-class`` images per class from each of the
train and test sets, pooled, then partitioned), 10 clients with 2 classes each (pathological),
the FedAvg CNN ``cnn4``, batch 10, 1 local epoch, FedProto, every client every round, evaluation
every round, 5 rounds, one torch thread per process.

The bare loop: for every client, one after another, a model kept in memory, SGD over its train
split with FedProto's loss (cross-entropy + lambda * MSE to the global prototype of the sample's
class), the prototype pass (per-class mean of eval-mode features over the train split), the
server's count-weighted prototype average (Eq. 6), then every client's head accuracy and
nearest-prototype accuracy on its test split (one features pass). It uses rafl's data loader
(the same batches) and rafl's model builder, nothing of the engine: no state files, no payloads,
no validation, no checkpoint, metrics or plots.

Each variant runs in its own process (``--variant``), back to back, in the order bare, w1, w2 and
again in the reverse order (``--repeats 2``); the parent samples the memory of the variant's
process tree every 0.1 s: peak RSS (shared pages counted in every process) and peak PSS
(proportional set size: pages shared by the forked workers counted once overall). Times exclude
loading the data (the same for every variant); rafl's include everything ``federate.run`` does
(state files, checkpoints, metrics files, the two plots at the end).

Run: ``nice -n 10 python bench/round_speed.py [--limit-per-class 250] [--big-clients 3000]``;
writes ``bench/results/round_speed.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = Path.home() / ".cache" / "rafl-data" / "cifar10"
TARBALL = ROOT.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"


def overrides(args, clients: int, limit: int | None, workers: int, rounds: int, per_round: int | None = None) -> list[str]:
    out = ["algorithm.name=fedproto", "data.dataset=cifar10", f"data.root={args.cifar}",
           "partition.scheme=pathological", "partition.k=2", f"clients.n={clients}", "clients.models=cnn4",
           "train.batch_size=10", "train.threads=1", "algorithm.local_epochs=1", f"engine.rounds={rounds}",
           f"engine.workers={workers}", f"seed={args.seed}"]
    if limit is not None:
        out.append(f"data.limit_per_class={limit}")
    if per_round is not None:
        out.append(f"engine.clients_per_round={per_round}")
    return out


# ---------------------------------------------------------------------- variants (child processes)
def run_rafl(args) -> dict:
    import torch

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    torch.set_num_threads(1)
    cfg = load_run_config(None, overrides(args, args.clients, args.limit_per_class, args.workers, args.rounds))
    prep = federate.prepare(cfg, progress=False)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        summary = federate.run(prep, Path(d) / "run", progress=False)
        wall = time.perf_counter() - t0
        hist = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "rounds_s": sum(r["time_s"] for r in hist),
            "client_update_s": sum(r["time_client_update_s"] for r in hist),
            "evaluate_s": sum(r["time_evaluate_s"] for r in hist), "engine_s": sum(r["time_engine_s"] for r in hist),
            "final": summary["final"], "hparams": prep.federation.hparams}


def run_bare(args) -> dict:
    import torch
    import torch.nn.functional as F

    from rafl.data import make_loader
    from rafl.federation.run_config import load_run_config
    from rafl.federation.training import no_singleton_batches
    from rafl.models import make_member
    from rafl.stages import federate

    torch.set_num_threads(1)
    cfg = load_run_config(None, overrides(args, args.clients, args.limit_per_class, 1, args.rounds))
    ds, part = federate.load_data_and_partition(cfg, progress=False)
    hp = get_hparams(cfg)
    n_classes = ds.num_classes
    lam = float(hp["lambda"])
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    models = [make_member("cnn4", n_classes, cfg.clients.feature_dim, 3, 32) for _ in part.clients]
    protos: dict[int, torch.Tensor] = {}
    acc = {}
    for rnd in range(1, args.rounds + 1):
        uploads = []
        for cid, split in enumerate(part.clients):
            model = models[cid].train()
            opt = torch.optim.SGD(model.parameters(), lr=hp["lr"], momentum=hp["momentum"], weight_decay=hp["weight_decay"])
            if protos:
                bank = torch.zeros(n_classes, next(iter(protos.values())).numel())
                has = torch.zeros(n_classes, dtype=torch.bool)
                for k, v in protos.items():
                    bank[k], has[k] = v, True
            batches = make_loader(ds, split.train, cfg.train.batch_size, shuffle=True, seed=rnd * 1000 + cid)
            for x, y in no_singleton_batches(batches):  # rafl's batches (a trailing 1-sample batch merged)
                feats = model.features(x)
                loss = F.cross_entropy(model.head(feats), y)
                if protos:
                    m = has[y]
                    loss = loss + lam * (feats[m] - bank[y][m]).pow(2).mean(-1).sum() / len(y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            model.eval()
            sums, counts = torch.zeros(n_classes, cfg.clients.feature_dim), torch.zeros(n_classes)
            with torch.no_grad():
                for x, y in make_loader(ds, split.train, cfg.train.batch_size, shuffle=False):
                    sums.index_add_(0, y, model.features(x))
                    counts += torch.bincount(y, minlength=n_classes)
            uploads.append((sums, counts))
        tot_s, tot_n = sum(u[0] for u in uploads), sum(u[1] for u in uploads)
        protos = {k: tot_s[k] / tot_n[k] for k in range(n_classes) if tot_n[k] > 0}
        bank = torch.stack([protos[k] for k in sorted(protos)])
        keys = torch.tensor(sorted(protos))
        head_acc, proto_acc = [], []
        for cid, split in enumerate(part.clients):
            model = models[cid].eval()
            c_h = c_p = n = 0
            with torch.no_grad():
                for x, y in make_loader(ds, split.test, cfg.train.batch_size, shuffle=False):
                    feats = model.features(x)
                    c_h += int((model.head(feats).argmax(1) == y).sum())
                    c_p += int((keys[torch.cdist(feats, bank).argmin(1)] == y).sum())
                    n += len(y)
            head_acc.append(c_h / max(n, 1))
            proto_acc.append(c_p / max(n, 1))
        acc = {"model.acc_mean_over_clients": statistics.mean(head_acc),
               "proto.acc_mean_over_clients": statistics.mean(proto_acc)}
    return {"wall_s": time.perf_counter() - t0, "final": acc}


def get_hparams(cfg) -> dict:
    from rafl.federation.algorithms import get_algorithm

    return get_algorithm(cfg.algorithm.name).check_hparams(cfg.algorithm.hparams())


def run_big(args) -> dict:
    """One round at ``--big-clients`` clients (``--big-per-round`` sampled): its evaluation time
    with the untrained clients one by one (``--shared 0``) or together (``--shared 1``)."""
    import torch

    from rafl.federation.run_config import load_run_config
    from rafl.stages import federate

    torch.set_num_threads(1)
    cfg = load_run_config(None, overrides(args, args.big_clients, args.big_limit, args.workers, 1, args.big_per_round)
                          + ["partition.min_samples=4"])
    prep = federate.prepare(cfg, progress=False)
    prep.federation.algorithm.shared_initial_evaluation = bool(args.shared)
    with tempfile.TemporaryDirectory() as d:
        federate.run(prep, Path(d) / "run", progress=False)
        row = json.loads((Path(d) / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return {"evaluate_s": row["time_evaluate_s"], "client_update_s": row["time_client_update_s"],
            "round_s": row["time_s"], "row": {k: v for k, v in row.items() if ".acc_" in k or k.startswith("eval.")}}


# ---------------------------------------------------------------------- the parent: memory sampling
def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    todo += [int(c) for c in fh.read().split()]
        except OSError:
            pass
    return out


def _memory(pid: int) -> tuple[int, int]:
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def child(args, extra: list[str]) -> dict:
    """Run this script with ``extra`` in a child process (niced like this one), sampling its tree's memory."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    cmd = [sys.executable, __file__, "--cifar", str(args.cifar), "--seed", str(args.seed), "--rounds", str(args.rounds),
           "--clients", str(args.clients), "--limit-per-class", str(args.limit_per_class), "--big-clients",
           str(args.big_clients), "--big-per-round", str(args.big_per_round),
           *(["--big-limit", str(args.big_limit)] if args.big_limit else []), *extra, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env)
    peak = [0, 0]
    while proc.poll() is None:
        rss, pss = _memory(proc.pid)
        peak = [max(peak[0], rss), max(peak[1], pss)]
        time.sleep(0.1)
    if proc.returncode != 0:
        raise SystemExit(f"variant {extra} failed with exit code {proc.returncode}")
    res = json.loads(out.read_text())
    out.unlink()
    res["peak_rss_mb"], res["peak_pss_mb"] = peak[0] / 2**20, peak[1] / 2**20
    print(f"  {' '.join(extra)}: {json.dumps({k: v for k, v in res.items() if k not in ('hparams', 'row')})}",
          flush=True)
    return res


def report(args, runs: dict[str, list[dict]], big: dict[str, dict], load: str) -> str:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    bare = med("bare", "wall_s")
    lines = [
        "# Round speed: rafl's FedProto rounds vs a bare PyTorch loop",
        "",
        f"Command: `nice -n 10 python bench/round_speed.py --limit-per-class {args.limit_per_class} --rounds {args.rounds} "
        f"--repeats {args.repeats} --big-clients {args.big_clients}`",
        "",
        f"Machine: {os.cpu_count()} cores, load average (1, 5, 15 min) {load} at the start and "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end. Ratios of variants run back to back are "
        "what this measures; absolute seconds, and the parallel speed-up above all, depend on the second core "
        "being free (a load average above ~1 at the start means another job shared the machine).",
        "",
        f"Scenario: CIFAR-10 subset ({args.limit_per_class} images per class from each split, pooled), "
        f"{args.clients} clients, pathological 2 classes each, `cnn4`, batch 10, 1 local epoch, FedProto "
        f"(lr {runs['w1'][0]['hparams']['lr']}, momentum {runs['w1'][0]['hparams']['momentum']}), "
        f"every client every round, evaluation every round, {args.rounds} rounds, 1 torch thread per process. "
        f"Each variant in its own process, {args.repeats} time(s), alternating order; medians.",
        "",
        "| variant | wall s | ratio to bare loop | rounds s (rafl) | client steps s | evaluation s | engine s "
        "| peak RSS MB | peak PSS MB | final model / proto acc |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("bare", "bare PyTorch loop"), ("w1", "rafl, engine.workers: 1"), ("w2", "rafl, engine.workers: 2")):
        r0 = runs[name][-1]
        fin = r0["final"]
        cells = [label, f"{med(name, 'wall_s'):.1f}", f"{med(name, 'wall_s') / bare:.2f}x"]
        if name == "bare":
            cells += ["", "", "", ""]
        else:
            cells += [f"{med(name, k):.1f}" for k in ("rounds_s", "client_update_s", "evaluate_s", "engine_s")]
        cells += [f"{max(r['peak_rss_mb'] for r in runs[name]):.0f}", f"{max(r['peak_pss_mb'] for r in runs[name]):.0f}",
                  f"{fin['model.acc_mean_over_clients']:.3f} / {fin['proto.acc_mean_over_clients']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Every run's wall seconds: " + "; ".join(f"{n} " + ", ".join(f"{r['wall_s']:.1f}" for r in runs[n])
                                                  for n in ("bare", "w1", "w2")) + ".",
        "rafl's wall time includes the end of the run (summary, the two plots: ~1-3 s of matplotlib import "
        "and drawing); `rounds s` is the sum of the rounds' `time_s`. With 2 workers `client steps s` is the "
        "wall time of the parallel section (state I/O included). The bare loop's accuracies differ from rafl's "
        "(its own initialization and shuffling); they show it learns the same task.",
        "Peak PSS counts the pages the forked workers share with the run's process (the dataset, the "
        "model code) once; peak RSS counts them in every process.",
        "",
        "Targets (issue 35): workers 1 <= 1.05x the bare loop: "
        f"**{med('w1', 'wall_s') / bare:.2f}x** (rounds alone {med('w1', 'rounds_s') / bare:.2f}x); workers 2 <= 0.6x: "
        f"**{med('w2', 'wall_s') / bare:.2f}x**; peak memory <= the bare loop's + 300 MB: PSS "
        f"{max(r['peak_pss_mb'] for r in runs['w2']):.0f} vs {max(r['peak_pss_mb'] for r in runs['bare']):.0f} + 300 MB.",
        "",
    ]
    if big:
        b0, b1 = big["one_by_one"], big["shared"]
        lines += [
            f"## One round at {args.big_clients} clients ({args.big_per_round} sampled), `engine.eval_clients: all`",
            "",
            f"CIFAR-10 ({'all 60,000 images' if not args.big_limit else f'{args.big_limit} images per class and split'}), "
            "pathological 2 classes per client, cnn4, FedProto, engine.workers: 1.",
            "",
            "| untrained clients evaluated | evaluation s | client steps s | round s |",
            "|---|---|---|---|",
            f"| one by one (before; with this change's one-pass FedProto evaluation) | {b0['evaluate_s']:.1f} | "
            f"{b0['client_update_s']:.1f} | {b0['round_s']:.1f} |",
            f"| together, one evaluation per model (after) | {b1['evaluate_s']:.1f} | {b1['client_update_s']:.1f} | "
            f"{b1['round_s']:.1f} |",
            "",
            f"Evaluation {b0['evaluate_s'] / b1['evaluate_s']:.0f}x faster. After: "
            f"`model.acc_mean_over_clients` {b1['row'].get('model.acc_mean_over_clients', float('nan')):.3f} covers the "
            f"{b1['row'].get('eval.trained_clients')} trained clients, "
            f"`model.acc_untrained_sample_weighted` {b1['row'].get('model.acc_untrained_sample_weighted', float('nan')):.3f} "
            f"the {b1['row'].get('eval.untrained_clients')} untrained ones (before, their mean over clients: "
            f"{b0['row'].get('model.acc_mean_over_clients', float('nan')):.3f} over all {args.big_clients}).",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cifar", type=Path, default=TREE if TREE.is_dir() else TARBALL)
    ap.add_argument("--limit-per-class", type=int, default=250)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--big-clients", type=int, default=3000, help="0: skip the large evaluation round")
    ap.add_argument("--big-per-round", type=int, default=10)
    ap.add_argument("--big-limit", type=int, default=None, help="images per class for the large round (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "round_speed")
    ap.add_argument("--variant", choices=["bare", "rafl", "big"], help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--shared", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        res = {"bare": run_bare, "rafl": run_rafl, "big": run_big}[args.variant](args)
        args.json.write_text(json.dumps(res))
        return
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    variants = {"bare": ["--variant", "bare"], "w1": ["--variant", "rafl", "--workers", "1"],
                "w2": ["--variant", "rafl", "--workers", "2"]}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for rep in range(args.repeats):
        order = list(variants) if rep % 2 == 0 else list(variants)[::-1]
        for name in order:
            runs[name].append(child(args, variants[name]))
    big = {}
    if args.big_clients:
        for key, shared in (("one_by_one", 0), ("shared", 1)):
            big[key] = child(args, ["--variant", "big", "--workers", "1", "--shared", str(shared)])
    text = report(args, runs, big, load)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "load_average_at_start": load, "runs": runs, "big": big},
                                                        indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
