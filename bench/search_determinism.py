"""Does ``rafl search`` pick the same subnets on every machine? The shipped supernet's three-profile
search, run as a new user runs it (a cold cache, no dataset), under several CPU kernel sets and
thread counts, and the accuracy predictor's raw (unrounded) predictions compared across them.

    python bench/search_determinism.py            # writes bench/results/search_determinism.md

"Another CPU" is emulated on this one: the kernels torch, MKL and OpenBLAS dispatch to are picked
by the CPU's instruction sets, and each library can be told to use an older set
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``OPENBLAS_CORETYPE``): AVX-512, AVX2 and
SSE4.2-era kernels sum in other orders and round differently, as another machine's do.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ("pi4", "jetson-nano", "phone")
#: name -> environment: the kernel sets a machine of another CPU generation would use
KERNELS = {
    "native (this CPU)": {},
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell"},
    "SSE4.2": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "OPENBLAS_CORETYPE": "Nehalem"},
}
#: the raw predictions of the predictor the search trains: printed by a child process
RAW = """
import json, sys
import numpy as np
import torch
from rafl.search.estimators import sample_across_space
from rafl.search.genome import Population
from rafl.search.predictor import train_predictor
from rafl.supernet import load_supernet
from rafl.supernet.pretrained import pretrained_path, supernet_measurements
folder = pretrained_path("cifar10")
doc = supernet_measurements(folder)
space = load_supernet(folder).space
archs = sample_across_space(space, doc["predictor_samples"]["n"], doc["predictor_samples"]["seed"])
acc = np.array([doc["accuracy"][a.canonical(space).to_string()] for a in archs])
model, _ = train_predictor(Population.from_archs(space, archs).encode(), acc, folds=0)
probe = Population.from_archs(space, sample_across_space(space, 2000, 1))
with torch.no_grad():
    raw = model(torch.as_tensor(probe.encode())).numpy()
json.dump({"raw": raw.tolist(), "rounded": model.predict(probe.encode()).tolist()}, sys.stdout)
"""


def env_for(kernels: dict[str, str], threads: int, cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAFL_DATA_ROOT", "ATEN_CPU_CAPABILITY",
                                                            "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")}
    env.update(kernels)
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "RAFL_CACHE_DIR": cache,
                "RAFL_DATA_ROOT": str(Path(cache) / "no-data-here"), "PYTHONPATH": str(ROOT)})
    return env


def search_picks(kernels: dict[str, str], threads: int) -> tuple[dict[str, dict], float]:
    """The three profiles' picks (arch, MACs, accuracy and its source) of one cold-cache search."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [sys.executable, "-m", "rafl", "search", "--supernet", "cifar10", "--out", str(out), "--quiet"]
        for p in PROFILES:
            cmd += ["--device-profile", p]
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env_for(kernels, threads, tmp), check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        picks = {}
        for p in PROFILES:
            r = json.loads((out / p / "result.json").read_text())
            picks[p] = {"arch": r["arch_string"], "macs_m": r["cost"]["macs_m"], "accuracy": r["accuracy"],
                        "source": r["accuracy_source"]}
        return picks, seconds


def raw_predictions(kernels: dict[str, str]) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-c", RAW], env=env_for(kernels, 1, tmp), check=True,
                             capture_output=True, text=True)
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "search_determinism.md")
    args = ap.parse_args()
    rows, picks_seen = [], set()
    for name, kernels in KERNELS.items():
        for threads in (1, 2):
            picks, seconds = search_picks(kernels, threads)
            key = json.dumps(picks, sort_keys=True)
            picks_seen.add(key)
            rows.append((name, threads, picks, seconds))
            print(f"{name:18s} {threads} thread(s): "
                  + "  ".join(f"{p} {v['macs_m']:.2f} M ({v['source']})" for p, v in picks.items())
                  + f"  {seconds:.0f} s", flush=True)
    raws = {name: raw_predictions(k) for name, k in KERNELS.items()}
    base = raws["native (this CPU)"]
    diffs = {name: (max(abs(a - b) for a, b in zip(r["raw"], base["raw"])),
                    sum(a != b for a, b in zip(r["rounded"], base["rounded"])))
             for name, r in raws.items() if name != "native (this CPU)"}
    first = rows[0][2]
    lines = ["# `rafl search` on every machine (bench/search_determinism.py)", "",
             "`python bench/search_determinism.py`: `rafl search --supernet cifar10 --device-profile pi4 "
             "--device-profile jetson-nano --device-profile phone`, a cold cache and no dataset each time, under the "
             "kernels of three CPU generations (AVX-512 is this machine's own; `ATEN_CPU_CAPABILITY`, "
             "`MKL_ENABLE_INSTRUCTIONS`, `OPENBLAS_CORETYPE` pick older ones) and 1 or 2 threads.", "",
             f"**{'identical picks in every run' if len(picks_seen) == 1 else 'THE PICKS DIFFER'}** "
             f"({len(rows)} runs).", "",
             "| kernels | threads | " + " | ".join(PROFILES) + " | seconds |",
             "|---|---|" + "---|" * len(PROFILES) + "---|"]
    for name, threads, picks, seconds in rows:
        lines.append(f"| {name} | {threads} | "
                     + " | ".join(f"{v['macs_m']:.2f} M, {v['accuracy']:.4f} ({v['source']})" for v in picks.values())
                     + f" | {seconds:.0f} |")
    lines += ["", "The picks:", ""]
    lines += [f"- {p}: `{v['arch']}`" for p, v in first.items()]
    lines += ["", "The predictor the search trains (float64, on the 500 shipped measurements), its raw predictions "
              "for 2,000 other subnets against this CPU's kernels, and its predictions as the search uses them "
              "(rounded to 6 decimals):", "",
              "| kernels | max abs difference, raw | rounded predictions that differ |", "|---|---|---|"]
    lines += [f"| {name} | {d:.2e} | {n} of {len(base['rounded'])} |" for name, (d, n) in diffs.items()]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2 - len(diffs):]))
    print(f"wrote {args.out}")
    if len(picks_seen) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
