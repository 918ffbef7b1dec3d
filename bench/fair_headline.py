"""The fair headline: every method tuned on validation data, scored under both protocols beside a
no-training floor, over seeds, with the tailoring ablation.

Per seed N (``--seeds 0,1,2``), two ``rafl compare`` runs on ``examples/cifar10-devices.yaml``
(``partition.global_test_per_class: 500``: half of the CIFAR-10 test split, 500 per class, held
out from every client and from the supernet):

1. ``OUT/seedN``: every method of ``--methods`` (``pretrained`` is the floor: each client's searched
   subnet, BN recalibrated, no rounds) with ``--tune lr=GRID`` (each method's learning rate picked
   on the clients' validation splits, the same number of trials for every method, picks in
   ``OUT/seedN/tune.json``); the global-model methods also get their fine-tuned rows
   (``uniform-ft``, ``heterofl-ft``, ``fedrolex-ft``).
2. ``OUT/seedN-weakest``: the tailoring ablation, ``--set clients.subnets=weakest`` (every client
   on the weakest device's subnet) for ``--ablation`` (default standalone, rafl, fedtgp), each with
   the learning rate its tuned run picked.

Then it writes ``bench/results/headline_fair<tag>.md`` / ``.json``:

- per method and protocol (personalized: each client's own test split; global: the held-out
  global test set), the final-round and the last-3-evaluations mean over clients, mean ± SE over
  seeds (SE = sd / sqrt(seeds));
- per method, the paired difference to the floor and to standalone over the clients (mean ±
  2 SE of the per-client differences), per seed, with ``*`` beyond 2 SE;
- the tailoring table: per tier, per-device minus weakest subnet accuracy, paired over the same
  clients (same seed, method and partition), mean ± 2 SE, per seed.

Run: ``python bench/fair_headline.py --data-root R`` (the full benchmark; many CPU hours on 2 cores:
3 lr trials + the final run + the ablation per seed); ``--from OUT`` summarizes finished runs;
``--smoke`` a small version (30 clients, 3 per round, 2 rounds, 200 global test images, a tiny
search) that exercises every part in well under an hour, written with the tag ``_smoke``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cifar10-devices.yaml"
METHODS = "pretrained,standalone,uniform,heterofl,fedrolex,rafl,fedgh,fedtgp,fedproto"
ABLATION = "standalone,rafl,fedtgp"
GRID = "0.01,0.03,0.1"
TIERS = ("pi4", "jetson-nano", "phone")
SMOKE = ["--set", "engine.workers=1", "--set", "clients.n=30", "--set", "engine.clients_per_round=3", "--set", "engine.rounds=2",
         "--set", "engine.eval_every=1", "--set", "partition.global_test_per_class=20",
         "--set", "search.generations=2", "--set", "search.population=8",
         "--set", "search.predictor_samples=8", "--set", "search.val_samples=64"]


def compare(args, out: Path, methods: str, extra: list[str]) -> None:
    if (out / "compare.json").is_file() and (out / "config.yaml").is_file():
        return  # finished (a half-finished one resumes below)
    cmd = ["rafl", "compare", "--no-progress"]
    if (out / "config.yaml").is_file():
        cmd += ["--resume", str(out)]
    else:
        cmd += ["--config", str(CONFIG.relative_to(ROOT)), "--data-root", str(args.data_root), "--out", str(out),
                "--algorithms", methods, *extra, *(SMOKE if args.smoke else [])]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def per_client(folder: Path, row: dict, key: str) -> dict[str, float]:
    """client id -> accuracy (``model.acc`` or ``model@global.acc``) of one row's final round."""
    base = row.get("finetuned_from")
    path = folder / base / "finetuned.json" if base else folder / row["algorithm"] / "summary.json"
    clients = json.loads(path.read_text())["clients"]
    return {c: v[key] for c, v in clients.items() if v.get(key) is not None}


def paired(a: dict[str, float], b: dict[str, float], clients: list[str] | None = None) -> tuple[float, float, int]:
    """Mean of a - b over the clients both have (or ``clients``), its standard error, the count."""
    common = sorted(set(a) & set(b) if clients is None else set(clients) & set(a) & set(b), key=int)
    d = [a[c] - b[c] for c in common]
    if not d:
        return float("nan"), float("nan"), 0
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else float("nan")
    return mean, se, len(d)


def over_seeds(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / math.sqrt(len(values)):.3f}"


def flag(mean: float, se: float) -> str:
    if math.isnan(mean):
        return "-"
    beyond = not math.isnan(se) and abs(mean) > 2 * se
    return f"{100 * mean:+.1f} ± {200 * se:.1f}{' *' if beyond else ''}"


def summarize(args, seeds: list[int]) -> str:
    rows = {s: {r["algorithm"]: r for r in json.loads((args.out / f"seed{s}" / "compare.json").read_text())["rows"]}
            for s in seeds}
    methods = [m for m in rows[seeds[0]] if all(m in rows[s] for s in seeds)]
    result: dict = {"seeds": seeds, "methods": {}, "tailoring": {}}
    lines = [f"# Fair headline: resource-aware FL on CIFAR-10{' (smoke scale)' if args.smoke else ''}", "",
             f"Seeds {', '.join(map(str, seeds))}; per seed `rafl compare --config examples/cifar10-devices.yaml "
             f"--algorithms {args.methods} --tune lr={args.grid} --set seed=N` (+ the ablation with "
             "`--set clients.subnets=weakest`). Written by `python bench/fair_headline.py"
             f"{' --smoke' if args.smoke else ''}`.", "",
             "Two protocols. **Personalized**: each client's deployed model on its own label-skewed test split "
             "(HtFLlib / PFLlib / FedTGP). **Global**: the same models on the held-out balanced global test set "
             "(HeteroFL / FedRolex / DepthFL); no client and no supernet saw it. `pretrained` is the no-training "
             "floor; `-ft` rows fine-tune the final global model locally for the same local epochs. Learning rates "
             "were picked per method on the clients' validation splits (`tune.json` per seed).", "",
             f"Mean over clients, mean ± SE over {len(seeds)} seed(s) (SE = sd / sqrt(seeds)): final round, and "
             "the mean of the last 3 evaluations.", "",
             "| method | personalized, final | personalized, last 3 | global, final | global, last 3 | lr picked "
             "(per seed) | MB up / down per client-round |", "|---|---|---|---|---|---|---|"]
    for m in methods:
        rs = [rows[s][m] for s in seeds]

        def col(key: str) -> list[float]:
            return [r.get(key, float("nan")) for r in rs]

        lrs = []
        for s in seeds:
            tune = args.out / f"seed{s}" / "tune.json"
            base = rows[s][m].get("finetuned_from", m)
            picked = json.loads(tune.read_text()).get("picked", {}).get(base, {}) if tune.is_file() else {}
            lrs.append(str(picked.get("lr", "-")))
        entry = {k: col(k) for k in ("model.acc_mean", "model.acc_mean_last3", "model@global.acc_mean",
                                      "model@global.acc_mean_last3")}
        result["methods"][m] = {**entry, "lr": lrs}
        lines.append(f"| {m} | " + " | ".join(over_seeds(v) for v in entry.values()) + f" | {' / '.join(lrs)} | "
                     f"{rs[0].get('mb_up_per_client_round', 0):.3f} / {rs[0].get('mb_down_per_client_round', 0):.3f} |")
    for ref in ("pretrained", "standalone"):
        if ref not in methods:
            continue
        lines += ["", f"Paired difference to **{ref}** over the clients every method evaluated (points, ± 2 SE over "
                  "clients; `*` beyond 2 SE), per seed: personalized | global.", "",
                  "| method | " + " | ".join(f"seed {s} personalized | seed {s} global" for s in seeds) + " |",
                  "|---|" + "---|---|" * len(seeds)]
        for m in methods:
            if m == ref:
                continue
            cells = []
            for s in seeds:
                folder = args.out / f"seed{s}"
                for key in ("model.acc", "model@global.acc"):
                    mean, se, _ = paired(per_client(folder, rows[s][m], key), per_client(folder, rows[s][ref], key))
                    cells.append(flag(mean, se))
                    result["methods"][m].setdefault(f"vs_{ref}", {}).setdefault(key, []).append([mean, se])
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    ablation = [m for m in args.ablation.split(",") if m in methods]
    if ablation and all((args.out / f"seed{s}-weakest" / "compare.json").is_file() for s in seeds):
        lines += ["", "**Tailoring ablation**: per-device subnets minus every client on the weakest device's subnet "
                  "(same method, seed, partition and lr), paired over each tier's clients (points, ± 2 SE; `*` beyond "
                  "2 SE), per seed: personalized | global.", "",
                  "| method | tier | " + " | ".join(f"seed {s} personalized | seed {s} global" for s in seeds) + " |",
                  "|---|---|" + "---|---|" * len(seeds)]
        for m in ablation:
            for tier in TIERS:
                cells = []
                for s in seeds:
                    folder, pinned = args.out / f"seed{s}", args.out / f"seed{s}-weakest"
                    prow = {r["algorithm"]: r for r in json.loads((pinned / "compare.json").read_text())["rows"]}[m]
                    table = json.loads((folder / m / "clients.json").read_text())["clients"]
                    ids = [str(r["client"]) for r in table if r["profile"] == tier]
                    for key in ("model.acc", "model@global.acc"):
                        mean, se, n = paired(per_client(folder, rows[s][m], key), per_client(pinned, prow, key), ids)
                        cells.append(flag(mean, se) + f" (n={n})")
                        result["tailoring"].setdefault(m, {}).setdefault(tier, {}).setdefault(key, []).append([mean, se, n])
                lines.append(f"| {m} | {tier} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    tag = "_smoke" if args.smoke else ""
    (ROOT / "bench" / "results" / f"headline_fair{tag}.md").write_text(text)
    (ROOT / "bench" / "results" / f"headline_fair{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", type=Path, default=Path.home() / ".cache" / "rafl-data" / "cifar10")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "headline-fair")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--ablation", default=ABLATION, help="methods of the tailoring ablation")
    ap.add_argument("--grid", default=GRID, help="the learning rates every method is tuned over")
    ap.add_argument("--smoke", action="store_true", help="a small CIFAR-10 version (minutes)")
    ap.add_argument("--from", dest="from_dir", type=Path, default=None, help="summarize finished runs in this folder")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.from_dir is not None:
        args.out = args.from_dir
    else:
        for s in seeds:
            folder = args.out / f"seed{s}"
            compare(args, folder, args.methods, ["--tune", f"lr={args.grid}", "--set", f"seed={s}"])
            picked = json.loads((folder / "tune.json").read_text()).get("picked", {})
            lrs = [x for m in args.ablation.split(",") if "lr" in picked.get(m, {})
                   for x in ("--set", f"algorithm.{m}.lr={picked[m]['lr']}")]
            compare(args, args.out / f"seed{s}-weakest", args.ablation,
                    ["--set", f"seed={s}", "--set", "clients.subnets=weakest", "--no-finetune", *lrs])
    print(summarize(args, seeds))


if __name__ == "__main__":
    sys.exit(main())
