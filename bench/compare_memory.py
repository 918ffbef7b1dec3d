"""Peak memory of ``rafl compare``'s preparation: every method built before the first round.

``rafl compare`` builds and checks every method (data, partition, subnets, clients' models) before
it writes anything. Each method used to load its own copy of the images (CIFAR-10: 60,000 float32
images, 737 MB per copy); :func:`rafl.stages.prepare.prepare`'s ``data`` lets them share one.
This script prepares ``--methods`` on a NAS scenario both ways, each variant in its own process
(back to back, ``--repeats`` times in alternating order), and prints the peak RSS of each and
their ratio (shared over separate copies).

Run: ``python bench/compare_memory.py [--config examples/cifar10-devices.yaml] [--methods A,B,C]
[--data-root ../shared/data/cifar10-jpeg.tar.gz]``; writes ``bench/results/compare_memory.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def variant(config: str, methods: list[str], data_root: str | None, shared: bool) -> dict:
    """Prepare every method as ``rafl compare`` does (shared data or a copy each); peak RSS in MB."""
    import torch

    from rafl.config import AlgorithmConfig
    from rafl.federation.run_config import load_run_config
    from rafl.stages.prepare import prepare

    torch.set_num_threads(1)
    sets = [f"data.root={data_root}"] if data_root else []
    cfg = load_run_config(config, sets)
    t0 = time.perf_counter()
    data, keep = None, []
    for name in methods:
        c = cfg.model_copy(deep=True)
        c.algorithm = AlgorithmConfig(name=name)
        prep = prepare(c, progress=False, data=data if shared else None)
        keep.append(prep.federation)  # compare keeps every method's federation until its turn
        if shared:
            data = (prep.dataset, prep.partition)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": time.perf_counter() - t0, "methods": len(keep)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "cifar10-devices.yaml"))
    ap.add_argument("--methods", default="pretrained,standalone,rafl")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variant", choices=["shared", "separate"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    methods = args.methods.split(",")
    if args.variant:
        print(json.dumps(variant(args.config, methods, args.data_root, args.variant == "shared")))
        return
    runs: dict[str, list[dict]] = {"separate": [], "shared": []}
    for r in range(args.repeats):
        for v in (("separate", "shared") if r % 2 == 0 else ("shared", "separate")):
            out = subprocess.run([sys.executable, __file__, "--variant", v, "--config", args.config, "--methods",
                                  args.methods, "--data-root", args.data_root], check=True, capture_output=True,
                                 text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            runs[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(v, runs[v][-1], flush=True)
    med = {v: statistics.median(x["peak_rss_mb"] for x in rs) for v, rs in runs.items()}
    sec = {v: statistics.median(x["seconds"] for x in rs) for v, rs in runs.items()}
    lines = ["# rafl compare: peak memory of preparing every method", "",
             f"`python bench/compare_memory.py --methods {args.methods} --repeats {args.repeats}` "
             f"({Path(args.config).name}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}); every variant in "
             "its own process, medians.", "",
             "| variant | peak RSS (MB) | preparation (s) |", "|---|---|---|",
             f"| a copy of the images per method (before) | {med['separate']:.0f} | {sec['separate']:.0f} |",
             f"| one shared copy (now) | {med['shared']:.0f} | {sec['shared']:.0f} |", "",
             f"Ratio shared / separate: peak RSS {med['shared'] / med['separate']:.2f}x, "
             f"time {sec['shared'] / sec['separate']:.2f}x ({len(methods)} methods)."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compare_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "compare_memory.json").write_text(json.dumps({"runs": runs, "methods": methods}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
