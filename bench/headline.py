"""The headline comparison (README's first screen): resource-aware FL on CIFAR-10, end to end.

Runs (or, with ``--from``, reads) ``rafl compare --config examples/cifar10-devices.yaml`` and keeps
its raw metrics under ``bench/results/headline_cifar10/``: the comparison's ``compare.{md,csv,json}``,
``compare.png``, ``compare_curve.png`` (accuracy vs cumulative MB) and ``config.yaml``, and per
method its ``metrics.jsonl``, ``summary.json`` and ``clients.json``. Writes
``bench/results/headline_cifar10.md``: the per-tier table, which differences are within noise (two
methods' pooled accuracies differ by less than twice the standard error of their difference,
``sqrt(se_a^2 + se_b^2)``, with the binomial standard errors of the clients' pooled test samples),
the hardware and the command.

Run: ``python bench/headline.py --data-root ~/.cache/rafl-data/cifar10 --out runs/headline``
(about an hour on 2 cores); ``--seed N`` for another seed (its own ``--out``, results in
``headline_cifar10_seedN``); ``--from runs/headline`` to package a finished comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = "standalone,uniform,heterofl,fedrolex,rafl,fedgh,fedtgp,fedproto"
CONFIG = ROOT / "examples" / "cifar10-devices.yaml"
KEEP = ("metrics.jsonl", "summary.json", "clients.json")


def command(args) -> list[str]:
    cmd = ["rafl", "compare", "--config", str(CONFIG.relative_to(ROOT)), "--data-root", str(args.data_root),
           "--out", str(args.out), "--algorithms", args.methods]
    if args.seed:
        cmd += ["--set", f"seed={args.seed}"]
    return cmd


def within_noise(rows: list[dict]) -> list[str]:
    """Pairs of methods whose pooled accuracies differ by less than 2 standard errors of the difference."""
    def pooled(r: dict) -> tuple[float, float] | None:  # over the clients every method evaluated, if known
        t = r.get("tiers_overall")
        if t:
            return t["acc_pooled"], t["se"]
        return (r["model.acc_pooled"], r["model.acc_pooled_se"]) if "model.acc_pooled_se" in r else None

    out = []
    for a, b in itertools.combinations(rows, 2):
        pa, pb = pooled(a), pooled(b)
        if pa is None or pb is None:
            continue
        se = math.hypot(pa[1], pb[1])  # as if independent: the same test images make it conservative
        d = pa[0] - pb[0]
        if abs(d) < 2 * se:
            out.append(f"{a['algorithm']} vs {b['algorithm']} ({d:+.4f}, 2 SE = {2 * se:.4f})")
    return out


def paired_over_clients(rows: list[dict], out: Path) -> list[str]:
    """Pairs of methods whose per-client accuracies differ, on average over the clients every method
    evaluated, by less than 2 standard errors of the mean paired difference (the same clients' test
    splits: a paired comparison, tighter than the pooled binomial one)."""
    acc = {}
    for r in rows:
        clients = json.loads((out / r["algorithm"] / "summary.json").read_text())["clients"]
        acc[r["algorithm"]] = {c: v["model.acc"] for c, v in clients.items() if v.get("model.acc") is not None}
    common = sorted(set.intersection(*(set(v) for v in acc.values())), key=int)
    res = []
    for a, b in itertools.combinations(acc, 2):
        d = [acc[a][c] - acc[b][c] for c in common]
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        if abs(mean) < 2 * se:
            res.append(f"{a} vs {b} ({mean:+.4f}, 2 SE = {2 * se:.4f})")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "rafl-data" / "cifar10")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "headline")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from", dest="from_dir", type=Path, default=None, help="package a finished comparison")
    args = ap.parse_args(argv)
    out = args.from_dir or args.out
    cmd = command(args)
    if args.from_dir is None:
        subprocess.run(cmd, check=True, cwd=ROOT)
    tag = "headline_cifar10" + (f"_seed{args.seed}" if args.seed else "")
    dest = ROOT / "bench" / "results" / tag
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("compare.md", "compare.csv", "compare.json", "compare.png", "compare_curve.png", "config.yaml"):
        shutil.copy2(out / name, dest / name)
    rows = json.loads((out / "compare.json").read_text())["rows"]
    for r in rows:
        (dest / r["algorithm"]).mkdir()
        for name in KEEP:
            shutil.copy2(out / r["algorithm"] / name, dest / r["algorithm"] / name)
    table = (out / "compare.md").read_text()
    tiers = table[table.index("Per device tier"):] if "Per device tier" in table else table
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    noise = within_noise(rows)
    paired = paired_over_clients(rows, out)
    lines = [f"# Resource-aware FL on CIFAR-10 (seed {args.seed})", "",
             "`" + " ".join(cmd) + "`" + ("" if args.from_dir is None else f" (packaged from `{args.from_dir}`)"), "",
             f"Hardware: {os.cpu_count()} CPU cores ({cpu}), CPU only, torch {_torch()}, Python "
             f"{platform.python_version()}; `engine.workers: 2`, one torch thread per process. Raw metrics: "
             f"`bench/results/{tag}/` (per method `metrics.jsonl`, `summary.json`, `clients.json`).", "",
             tiers.strip(), "",
             "Differences within noise, paired over the clients (mean per-client accuracy difference within 2 "
             "standard errors of the paired differences): " + ("; ".join(paired) if paired else "none") + ".", "",
             "Within noise as pooled accuracies (closer than 2 binomial standard errors of their difference, as if "
             "independent; conservative, the test images are the same): " + ("; ".join(noise) if noise else "none")
             + ".", "",
             "![accuracy vs cumulative MB](" + f"{tag}/compare_curve.png)", ""]
    (ROOT / "bench" / "results" / f"{tag}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def _torch() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return "?"


if __name__ == "__main__":
    sys.exit(main())
