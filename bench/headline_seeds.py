"""The headline comparison over seeds: each method's accuracy per device tier and overall, as the
mean and spread over the seeds that ``bench/headline.py`` packaged.

Reads ``bench/results/headline_cifar10/`` (seed 0) and ``headline_cifar10_seed<N>/`` (each: one
``rafl compare`` of the eight methods with ``--set seed=N``: another partition, another search,
other client seeds). Writes ``bench/results/headline_cifar10_seeds.md`` and ``.json``:

- per method and tier: the pooled accuracy (correct / test samples of the tier's clients) of each
  seed, their mean and sample standard deviation over seeds (ddof 1);
- per method: the paired difference to standalone, mean over the clients every method evaluated,
  with its 2 SE over clients, per seed; and in how many seeds it is beyond 2 SE;
- MB up / down per participating client per round (the mean over seeds).

Run: ``python bench/headline_seeds.py`` (reads only; seconds).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TIERS = ("pi4", "jetson-nano", "phone")


def seed_dirs() -> dict[int, Path]:
    found = {0: RESULTS / "headline_cifar10"}
    for p in sorted(RESULTS.glob("headline_cifar10_seed*")):
        if p.is_dir() and p.name.removeprefix("headline_cifar10_seed").isdigit():
            found[int(p.name.removeprefix("headline_cifar10_seed"))] = p
    return {s: p for s, p in sorted(found.items()) if (p / "compare.json").is_file()}


def paired_to_standalone(folder: Path, methods: list[str]) -> dict[str, tuple[float, float, int]]:
    """method -> (mean per-client accuracy difference to standalone, its SE, clients), over the
    clients every method evaluated."""
    acc = {}
    for m in methods:
        clients = json.loads((folder / m / "summary.json").read_text())["clients"]
        acc[m] = {c: v["model.acc"] for c, v in clients.items() if v.get("model.acc") is not None}
    common = sorted(set.intersection(*(set(v) for v in acc.values())), key=int)
    out = {}
    for m in methods:
        d = [acc[m][c] - acc["standalone"][c] for c in common]
        mean = sum(d) / len(d)
        se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else float("nan")
        out[m] = (mean, se, len(d))
    return out


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    seeds = seed_dirs()
    data = {s: json.loads((p / "compare.json").read_text())["rows"] for s, p in seeds.items()}
    methods = [r["algorithm"] for r in data[min(seeds)]]
    methods = [m for m in methods if all(any(r["algorithm"] == m for r in rows) for rows in data.values())]
    table: dict[str, dict] = {}
    for m in methods:
        rows = {s: next(r for r in data[s] if r["algorithm"] == m) for s in seeds}
        entry = {"tiers": {t: [rows[s]["tiers"][t]["acc_pooled"] for s in seeds] for t in TIERS},
                 "overall": [rows[s]["tiers_overall"]["acc_pooled"] for s in seeds],
                 "mb_up": statistics.mean(rows[s]["mb_up_per_client_round"] for s in seeds),
                 "mb_down": statistics.mean(rows[s]["mb_down_per_client_round"] for s in seeds)}
        table[m] = entry
    paired = {s: paired_to_standalone(p, methods) for s, p in seeds.items()}
    for m in methods:
        table[m]["paired_to_standalone"] = {s: {"mean": paired[s][m][0], "se": paired[s][m][1],
                                                "clients": paired[s][m][2]} for s in seeds}

    n = len(seeds)
    lines = ["# Resource-aware FL on CIFAR-10 over seeds", "",
             f"Seeds {', '.join(map(str, seeds))} of `python bench/headline.py --seed N` (`rafl compare --config "
             "examples/cifar10-devices.yaml --set seed=N`, the eight methods): each seed is another Dirichlet-0.5 "
             "partition of the 20 clients, another subnet search and other client seeds; 12 rounds, 5 clients per "
             "round, 1 local epoch. Written by `python bench/headline_seeds.py`.", "",
             f"Pooled test accuracy per tier and overall (over the clients every method evaluated): mean ± standard "
             f"deviation over the {n} seeds (ddof 1). MB: payload per participating client per round, mean over seeds.",
             "", "| method | pi4 | jetson-nano | phone | overall | per seed (overall) | MB up / down |",
             "|---|---|---|---|---|---|---|"]
    for m in methods:
        e = table[m]
        lines.append(f"| {m} | " + " | ".join(spread(e["tiers"][t]) for t in TIERS) + f" | **{spread(e['overall'])}** | "
                     + " / ".join(f"{v:.3f}" for v in e["overall"]) + f" | {e['mb_up']:.3f} / {e['mb_down']:.3f} |")
    lines += ["", "Paired difference to standalone (mean over the clients every method evaluated of the per-client "
              "accuracy difference, ± 2 SE over those clients), per seed; `*`: beyond 2 SE.", "",
              "| method | " + " | ".join(f"seed {s}" for s in seeds) + " | seeds beyond 2 SE (better / worse) |",
              "|---|" + "---|" * n + "---|"]
    for m in methods:
        if m == "standalone":
            continue
        cells, better, worse = [], 0, 0
        for s in seeds:
            p = table[m]["paired_to_standalone"][s]
            beyond = abs(p["mean"]) > 2 * p["se"]
            better += beyond and p["mean"] > 0
            worse += beyond and p["mean"] < 0
            cells.append(f"{100 * p['mean']:+.1f} ± {200 * p['se']:.1f}{' *' if beyond else ''}")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {better} / {worse} of {n} |")
    lines += ["", "Points are accuracy percentage points. Per-seed tables (per tier, pooled ± binomial SE, the subnets "
              "and their budgets): " + ", ".join(f"`{p.relative_to(RESULTS.parent.parent)}.md`" for p in seeds.values())
              + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    (RESULTS / "headline_cifar10_seeds.md").write_text(text)
    (RESULTS / "headline_cifar10_seeds.json").write_text(json.dumps({"seeds": list(seeds), "methods": table},
                                                                    indent=2) + "\n")


if __name__ == "__main__":
    main()
