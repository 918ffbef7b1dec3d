"""Several runs on one GPU at once (issue 60): the cross-device workload's training throughput with K
``rafl federate`` runs sharing one device, against one run alone.

The cross-device clients' subnets (3-9 M MACs at 32 px, batch 32) leave a GPU mostly idle: a client
step is a few small kernels, launch-bound. Running several runs (e.g. the map's cells,
``bench/gpu_map.sh``) side by side fills it. This measures how much: for each K of ``--runs``, K runs
of ``--config`` (seeds 0..K-1, ``engine.workers`` 1, ``train.device`` ``--device``) start together;
each run's training throughput is its trained images (clients that took part x their training
images x local epochs, from ``metrics.jsonl`` and ``clients.json``) over its summed
``time_client_update_s`` (the rounds' client steps: no search, data loading or evaluation), and K's
throughput is all runs' images over the longest of those sums (the span in which they all trained).
The ratio to K = 1 is the gain of sharing the device. The first K warms the search cache, so later
runs start at their rounds.

Run (on a machine with a GPU): ``python bench/gpu_concurrency.py --data-root R [--runs 1,2,4,8] [--rounds 3]``;
``--device cpu`` runs the same on the CPU (a check of the script, not a GPU figure). Writes
``bench/results/gpu_concurrency.md`` / ``.json`` (``--results``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cifar10-cross-device-500.yaml"


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def throughput(run_dir: Path, local_epochs: int) -> tuple[int, float]:
    """``(trained images, seconds of client steps)`` of one finished ``rafl federate`` run."""
    (method,) = [p for p in run_dir.iterdir() if (p / "metrics.jsonl").is_file()] or [run_dir]
    rows = [json.loads(line) for line in (method / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sizes = [c["n_train"] for c in json.loads((method / "clients.json").read_text())["clients"]]
    per_client = statistics.median(sizes)  # balanced-dirichlet: every client holds the same number
    images = sum(int(r["participated"]) for r in rows) * per_client * local_epochs
    return int(images), sum(float(r["time_client_update_s"]) for r in rows)


def run_batch(args, k: int) -> dict:
    """K runs started together; their throughputs and the batch's."""
    procs, dirs = [], []
    for i in range(k):
        out = args.out / f"k{k}" / f"run{i}"
        dirs.append(out)
        cmd = [sys.executable, "-m", "rafl", "federate", "--no-progress", "--config", str(args.config),
               "--data-root", str(args.data_root), "--out", str(out), "--set", f"algorithm.name={args.algorithm}",
               "--set", f"train.device={args.device}", "--set", "engine.workers=1",
               "--set", f"engine.rounds={args.rounds}", "--set", f"engine.eval_every={args.rounds}",
               "--set", f"algorithm.local_epochs={args.local_epochs}", "--set", f"seed={i}",
               *[x for kv in args.set for x in ("--set", kv)]]
        log = open(args.out / f"k{k}-run{i}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
    start = time.time()
    failed = []
    for i, (p, log) in enumerate(procs):
        if p.wait() != 0:
            failed.append(i)
        log.close()
    wall = time.time() - start
    if failed:
        die(f"K={k}: run(s) {failed} failed; see {args.out}/k{k}-run<i>.log")
    runs = [throughput(d, args.local_epochs) for d in dirs]
    images = sum(n for n, _ in runs)
    span = max(s for _, s in runs)
    return {"k": k, "wall_s": wall, "images": images, "span_s": span, "img_per_s": images / span,
            "per_run_img_per_s": [n / s for n, s in runs]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", type=Path, required=True)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--runs", default="1,2,4,8", help="K values: runs at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--algorithm", default="uniform")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to every run")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-concurrency")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    try:
        ks = [int(k) for k in args.runs.split(",")]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        die(f"--runs {args.runs!r}: allowed: comma-separated integers >= 1")
    if args.rounds < 1 or args.local_epochs < 1:
        die(f"--rounds {args.rounds} / --local-epochs {args.local_epochs}: allowed: integers >= 1")
    if not args.data_root.exists():
        die(f"--data-root {args.data_root}: does not exist; allowed: the CIFAR-10 tarball or its unpacked tree")
    if args.out.exists() and any(args.out.iterdir()):
        die(f"--out {args.out}: is not empty; allowed: a new or empty folder")
    args.out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            die("--device cuda: no CUDA device on this machine; allowed here: --device cpu")
        device = f"{torch.cuda.get_device_name(0)} ({device})"
    command = "python bench/gpu_concurrency.py " + " ".join(argv if argv is not None else sys.argv[1:])
    batches = []
    for k in sorted(set(ks)):
        batches.append(run_batch(args, k))
        b = batches[-1]
        print(f"K={k}: {b['img_per_s']:.0f} img/s over {b['span_s']:.0f} s of client steps ({b['wall_s']:.0f} s wall)",
              flush=True)
    base = batches[0]["img_per_s"]
    lines = ["# Several runs on one device at once", "", f"Command: `{command}`. Device: {device}. Workload: "
             f"`{args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}`, "
             f"`{args.algorithm}`, {args.rounds} rounds, {args.local_epochs} local epoch(s). Throughput = trained "
             "images / seconds of client steps (the longest run's, for K runs).", "",
             f"| runs at once | img/s | x K={batches[0]['k']} | img/s per run | wall s |", "|---|---|---|---|---|"]
    for b in batches:
        lines.append(f"| {b['k']} | {b['img_per_s']:.0f} | {b['img_per_s'] / base:.2f} | "
                     f"{statistics.median(b['per_run_img_per_s']):.0f} | {b['wall_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "gpu_concurrency.md").write_text(text)
    (args.results / "gpu_concurrency.json").write_text(json.dumps({"command": command, "device": device,
                                                                   "batches": batches}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
