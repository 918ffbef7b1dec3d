"""Peak memory of ``rafl compare``'s preparation: every method built before the first round.

``rafl compare`` builds and checks every method (data, partition, subnets, clients' models) before
it writes anything. Each method used to load its own copy of the images and every method's
federation (its clients' models, the supernet) stayed in memory until its turn. Now the methods
share one copy of the images (:func:`rafl.stages.prepare.prepare`'s ``data``) and each is built
to be checked, dropped, and built again for its run (``rafl.stages.compare.methods.method_builder``).
This script prepares ``--methods`` on a NAS scenario both ways, each variant in its own process
(back to back, ``--repeats`` times in alternating order), and prints the peak RSS of each and
their ratio.

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


def variant(config: str, methods: list[str], data_root: str | None, now: bool) -> dict:
    """Prepare every method as ``rafl compare`` does (``now``: its method builder, one method in
    memory at a time, built again for its run; else a copy of the data per method, every method
    kept, as before); peak RSS in MB."""
    import gc

    import torch

    from rafl.config import AlgorithmConfig
    from rafl.federation.run_config import load_run_config
    from rafl.models import resolve_models
    from rafl.stages.compare.methods import method_builder
    from rafl.stages.prepare import prepare

    torch.set_num_threads(1)
    sets = [f"data.root={data_root}"] if data_root else []
    cfg = load_run_config(config, sets)
    t0 = time.perf_counter()
    if now:
        hparams = {m: {} for m in methods}
        build = method_builder(cfg, hparams, resolve_models(cfg.clients.models), cfg.clients.feature_dim, False,
                                False)
        built = {}
        for name in methods:  # the check pass
            fed, _, prep = build(name)
            fed.algorithm.init_server(fed.server)
            if not built:
                built[name] = (fed, prep)
            del fed, prep
        for name in methods:  # the runs' turns (no rounds here): one federation at a time
            fed, prep = built.pop(name) if name in built else build(name)[::2]
            del fed, prep
            gc.collect()
    else:
        keep = []
        for name in methods:
            c = cfg.model_copy(deep=True)
            c.algorithm = AlgorithmConfig(name=name)
            keep.append(prepare(c, progress=False).federation)
            keep[-1].algorithm.init_server(keep[-1].server)
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "seconds": time.perf_counter() - t0, "methods": len(methods)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "examples" / "cifar10-devices.yaml"))
    ap.add_argument("--methods", default="pretrained,standalone,rafl,fedgh,fedproto")
    ap.add_argument("--data-root", default=str(REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variant", choices=["now", "before"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    methods = args.methods.split(",")
    if args.variant:
        print(json.dumps(variant(args.config, methods, args.data_root, args.variant == "now")))
        return
    runs: dict[str, list[dict]] = {"before": [], "now": []}
    for r in range(args.repeats):
        for v in (("before", "now") if r % 2 == 0 else ("now", "before")):
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
             f"| before: a copy of the images per method, every method kept | {med['before']:.0f} | "
             f"{sec['before']:.0f} |",
             f"| now: one copy of the images, one method's models at a time | {med['now']:.0f} | {sec['now']:.0f} |",
             "", f"Ratio now / before: peak RSS {med['now'] / med['before']:.2f}x, time {sec['now'] / sec['before']:.2f}x "
             f"({len(methods)} methods; the time includes building each method a second time for its run)."]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compare_memory.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "compare_memory.json").write_text(json.dumps({"runs": runs, "methods": methods}, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
