"""`rafl search --device-profile pi4.yaml` right after the quickstart, before and after a change.

    python bench/search_after_quickstart.py [--base 1cbeba5] [--predictor-samples 500]

For each code version (``--base``: a git revision, checked out with ``git worktree`` under a
temporary folder, when given; and this tree), back to back, in a fresh ``RAFL_CACHE_DIR`` holding the same
trained quickstart supernet (copied from ``--supernet-cache``, trained there once if missing):

1. what ``rafl federate``'s quickstart measures for its search (the default run config's
   ``search`` section: population 24, 10 generations, 16 predictor samples, top-2, seed 0, over
   its profiles pi4 / jetson-nano / phone, on the supernet's server split), with that version;
2. then, timed, ``rafl search --device-profile pi4.yaml --predictor-samples N --out ...`` with that
   version (a subprocess; 2 measuring workers by default, as on a 2-core machine).

Writes ``bench/results/search_after_quickstart.md`` / ``.json``: each version's wall time, the
subnets its search measured (cache entries added) and the ratio after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART = """
import sys
from rafl.config import RunConfig
from rafl.search.evolution import SearchConfig, search_subnets
from rafl.stages.search import load_search_supernet, server_eval_data
cfg = RunConfig()
s = cfg.search
supernet, meta = load_search_supernet(None, progress=False)
val, calib, _ = server_eval_data(meta.get("config"), supernet.space, progress=False)
search_subnets(supernet, list(cfg.clients.profiles), val, calib,
               SearchConfig(population=s.population, generations=s.generations, estimator=s.estimator,
                            predictor_samples=s.predictor_samples, top_k=s.top_k, seed=cfg.seed, progress=False))
"""

TRAIN = "from rafl.supernet import quickstart_supernet; quickstart_supernet(progress=False)"


def cache_entries(cache: Path) -> int:
    n = 0
    for f in (cache / "search-measurements").glob("*.json"):
        n += len(json.loads(f.read_text()).get("accuracy", {}))
    return n


def run_version(name: str, root: Path, supernet_cache: Path, samples: int, workers: int, work: Path) -> dict:
    cache = work / f"cache-{name}"
    shutil.copytree(supernet_cache, cache, ignore=shutil.ignore_patterns("search-measurements", "federate-search"))
    env = {**os.environ, "RAFL_CACHE_DIR": str(cache), "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", QUICKSTART], env=env, check=True, cwd=work)
    t_quick = time.perf_counter() - t0
    before = cache_entries(cache)
    cmd = [sys.executable, "-m", "rafl", "search", "--device-profile", "pi4.yaml", "--predictor-samples", str(samples),
           "--out", str(work / f"out-{name}"), "--quiet"]
    if "--workers" in subprocess.run([sys.executable, "-m", "rafl", "search", "--help"], env=env, cwd=work,
                                     capture_output=True, text=True).stdout:
        cmd += ["--workers", str(workers)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{name}: rafl search failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return {"version": name, "quickstart_measuring_s": round(t_quick, 1), "quickstart_measured": before,
            "search_s": round(wall, 1), "search_measured": cache_entries(cache) - before,
            "pick": res.stdout.strip().splitlines()[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git revision of the 'before' code (none: time this tree only)")
    ap.add_argument("--predictor-samples", type=int, default=500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--supernet-cache", type=Path, default=Path(tempfile.gettempdir()) / "rafl-bench-quickstart",
                    help="a RAFL_CACHE_DIR holding the trained quickstart supernet (trained here if missing)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "search_after_quickstart")
    args = ap.parse_args()

    args.supernet_cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", TRAIN], check=True,
                   env={**os.environ, "RAFL_CACHE_DIR": str(args.supernet_cache), "PYTHONPATH": str(ROOT)})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = work / "base"
        if args.base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                           capture_output=True)
        try:
            if args.base:
                rows.append(run_version(f"before ({args.base})", base, args.supernet_cache, args.predictor_samples,
                                        args.workers, work))
            head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            rows.append(run_version(f"after ({head} + working tree)", ROOT, args.supernet_cache,
                                    args.predictor_samples, args.workers, work))
        finally:
            if args.base:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                               capture_output=True)
    ratio = rows[1]["search_s"] / rows[0]["search_s"] if args.base else None
    doc = {"command": " ".join(["python", "bench/search_after_quickstart.py", *sys.argv[1:]]),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
           "predictor_samples": args.predictor_samples, "workers": args.workers, "rows": rows,
           "ratio_after_before": None if ratio is None else round(ratio, 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# `rafl search --device-profile pi4.yaml` after the quickstart (bench/search_after_quickstart.py)", "",
             f"`{doc['command']}`; {doc['machine']}; --predictor-samples {args.predictor_samples}, "
             f"{args.workers} measuring workers", "",
             "| version | quickstart measured | search wall (s) | subnets the search measured |", "|---|---|---|---|"]
    lines += [f"| {r['version']} | {r['quickstart_measured']} | {r['search_s']} | {r['search_measured']} |" for r in rows]
    last = rows[-1]["search_s"]
    lines += ["", (f"ratio after / before: **{ratio:.2f}x**; " if ratio is not None else "")
              + f"this tree: **{last} s** (target: <= 60 s: {'met' if last <= 60 else 'not met'})", ""]
    args.out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
