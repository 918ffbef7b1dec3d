"""FedGH's server epochs: the global header's accuracy vs Standalone for several ``server_epochs``.

FedGH's Algorithm 1 (Yi et al., MM 2023) shows one SGD pass over the round's LARs; HtFLlib's FedGH
(``servergh.py``, the FedTGP paper's FedGH baseline) makes ``server_epochs`` = 100 passes. The
paper leaves the count open and it decides how far the header moves per round (one pass = one
step per LAR at ``server_lr`` 0.01), so this bench measures it: for every ``--epochs`` value, on
the scenarios of ``bench/htfl_bench.py`` (same partitions, models, settings and seeds), FedGH's
three inference rules (global header, + label prior, local header) as paired per-seed
differences vs Standalone, on the mean accuracy over clients and (where the cached runs recorded
it) on the pooled accuracy of all clients' test samples.

Run: ``python bench/fedgh_sweep.py --epochs 1,10,100 --seeds 0,1,2,3 [--only digits-pat2-train20]
[--mode per-client] --jobs 2 --out DIR``; writes ``bench/results/fedgh_sweep[_<only>][_per-client].md`` and
``.json``. Results are cached like ``htfl_bench.py``'s, under the same ``--out`` (``<scenario>/seed<s>/fedgh-se<E>.json``;
Standalone's ``standalone.json`` is shared with it, so give both benches one ``--out``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from rafl.stages.compare import load_compare_config

import htfl_bench as hb

RULES = (("global header", "model.acc_tail"), ("+ label prior", "prior.acc_tail"), ("local header", "local.acc_tail"))


def sweep_seed(name: str, overrides: list[str], out: Path, rounds: int, dim: int, seed: int, tail: int, device: str,
               epochs: list[int], mode: str = "per-lar") -> dict:
    """Standalone and FedGH at every ``epochs`` value (``server_mode`` = ``mode``) on one
    partition/seed (cached per run)."""
    torch.set_num_threads(1)
    sets = hb._method_sets(overrides, rounds, seed, device)
    cfg, hps = load_compare_config(None, sets, ["standalone"])
    held = hb.client_classes(cfg, dim)
    rows = {"standalone": hb.cached_method(name, "standalone", sets, cfg, hps["standalone"], held, out, dim, seed,
                                           tail)["row"]}
    # the default mode adds no --set and no tag suffix, so its cache entries stay valid
    mode_sets, mode_tag = ([], "") if mode == "per-lar" else ([f"algorithm.fedgh.server_mode={mode}"], f"-{mode}")
    for e in epochs:
        vsets = sets + [f"algorithm.fedgh.server_epochs={e}"] + mode_sets
        vcfg, vhps = load_compare_config(None, vsets, ["fedgh"])
        rows[e] = hb.cached_method(name, "fedgh", vsets, vcfg, vhps["fedgh"], held, out, dim, seed, tail,
                                   tag=f"fedgh-se{e}{mode_tag}")["row"]
    return {"seed": seed, "rows": rows}


def _sweep_seed_star(args: tuple) -> dict:
    return sweep_seed(*args)


def summarize(name: str, runs: list[dict], epochs: list[int]) -> dict:
    """Per ``server_epochs`` and inference rule (mean over clients, and pooled where every seed has
    it): mean accuracy over seeds, per-seed paired difference vs Standalone on the same metric
    (points), its mean, and on how many seeds it is positive."""
    # a run that diverged (:func:`htfl_bench.run_method`) is named and left out of the comparisons
    # on its seed
    diverged = [f"{'Standalone' if tag == 'standalone' else f'server_epochs {tag}'}, seed {r['seed']}, round "
                f"{row['diverged_round']}: {row['diverged']}" for r in runs for tag, row in r["rows"].items()
                if "diverged" in row]
    runs_sa = [r for r in runs if "diverged" not in r["rows"]["standalone"]]
    sa = [r["rows"]["standalone"]["model.acc_tail"] for r in runs_sa]
    sa_pooled = [r["rows"]["standalone"].get("model.acc_tail_pooled") for r in runs_sa]
    table = []
    for e in epochs:
        done = [r for r in runs_sa if "diverged" not in r["rows"][e]]
        if not done:
            continue
        # each rule on the mean over clients, then (where every run recorded it) on the pooled test
        # samples of all clients, against Standalone's accuracy on the same metric
        rules = [(rule, key, "model.acc_tail") for rule, key in RULES] + [
            (f"{rule}, pooled", key + "_pooled", "model.acc_tail_pooled") for rule, key in RULES]
        for rule, key, base_key in rules:
            acc = [r["rows"][e].get(key) for r in done]
            base = [r["rows"]["standalone"].get(base_key) for r in done]
            if None in acc or None in base:
                continue
            diffs = [100 * (a - b) for a, b in zip(acc, base)]
            table.append({"server_epochs": e, "rule": rule, "acc": statistics.fmean(acc), "per_seed": diffs,
                          "seeds": [r["seed"] for r in done], "mean": statistics.fmean(diffs),
                          "holds": sum(d > 0 for d in diffs), "n": len(diffs),
                          "wall_s": statistics.fmean(r["rows"][e]["wall_s"] for r in runs)})
    return {"scenario": name, "standalone": statistics.fmean(sa) if sa else None, "standalone_per_seed": sa,
            "standalone_pooled": None if not sa or None in sa_pooled else statistics.fmean(sa_pooled),
            "table": table, "diverged": diverged}


def report(results: list[dict], args, argv: list[str]) -> str:
    lines = ["# FedGH server epochs (`python bench/fedgh_sweep.py " + " ".join(argv) + "`)", "",
             f"The settings of `bench/htfl_bench.py` ({args.rounds} rounds, htfe-tiny, D = {args.feature_dim}, "
             f"seeds {', '.join(map(str, args.seeds))}, accuracy = mean of the last {args.tail} rounds), FedGH at its "
             f"defaults but `server_epochs` (`server_mode: {args.mode}`). Rules, all from the same runs: "
             "**global header** (the paper's deployed "
             "model), **+ label prior** (`label_prior: local`), **local header** (`deploy_header: local`); "
             "accuracy is the mean over clients, and *pooled* (where the runs recorded it) the accuracy on all "
             "clients' test samples together (HtFLlib's \"Averaged Test Accuracy\"). "
             "Differences are paired per seed (same partition, init and data order as Standalone).", ""]
    for res in results:
        pooled = "" if res["standalone_pooled"] is None else f", pooled {res['standalone_pooled']:.4f}"
        sa = "diverged" if res["standalone"] is None else f"{res['standalone']:.4f}"
        lines += [f"## {res['scenario']} (Standalone {sa}{pooled})", "",
                  "| server_epochs | rule | acc | vs Standalone, per seed (points) | mean | holds on | wall s / seed |",
                  "|---|---|---|---|---|---|---|"]
        for t in res["table"]:
            partial = len(t.get("seeds", args.seeds)) < len(args.seeds)  # a diverged run left a seed out
            per = ", ".join(f"seed {sd} {d:+.2f}" if partial else f"{d:+.2f}"
                            for sd, d in zip(t.get("seeds", args.seeds), t["per_seed"]))
            lines.append(f"| {t['server_epochs']} | {t['rule']} | {t['acc']:.4f} | "
                         f"{per} | {t['mean']:+.2f} | "
                         f"{t['holds']}/{t['n']} seeds | {t['wall_s']:.0f} |")
        if res.get("diverged"):
            lines += ["", "Diverged runs (left out of the comparisons on their seed):", ""]
            lines += [f"- {d}" for d in res["diverged"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def _epochs(text: str) -> list[int]:
    """``--epochs``: distinct integers >= 1, e.g. ``1,10,100``."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of integers >= 1, e.g. 1,10,100") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers >= 1, e.g. 1,10,100")
    return values


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    hb.add_common_args(ap)
    ap.add_argument("--epochs", type=_epochs, default=[1, 10, 100], help="comma list of FedGH server_epochs values")
    ap.add_argument("--mode", choices=["per-lar", "per-client"], default="per-lar",
                    help="FedGH's server_mode: one SGD step per LAR (the paper) or per client's LARs")
    args = ap.parse_args(argv)
    scenarios, only = hb.selected(ap, args)
    results = []
    for name, sets in scenarios.items():
        print(f"== {name}", flush=True)
        work = [(name, sets, args.out, args.rounds, args.feature_dim, s, args.tail, args.device, args.epochs,
                 args.mode) for s in args.seeds]
        t0 = time.perf_counter()
        runs = hb.map_seeds(_sweep_seed_star, work, args.jobs)
        res = summarize(name, runs, args.epochs) | {"elapsed_s": time.perf_counter() - t0}
        results.append(res)
    text = report(results, args, argv)
    print(text)
    hb.write_results("fedgh_sweep", only, args, text, results, "" if args.mode == "per-lar" else f"_{args.mode}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
