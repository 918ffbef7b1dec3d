"""The federated supernet, searched again: do the subnets found after HeteroFL beat those found before?

Takes a ``rafl compare`` output whose ``heterofl`` run federated NAS subnets (its server's global
model, the whole supernet, is saved as ``OUT/heterofl/supernet.*``; FedorAS / SuperFedNAS search
such a supernet again). With the comparison's own config (data, partition, profiles, search
settings, seed), one subnet per device profile is searched on the pretrained supernet (before)
and on the federated one (after, ``supernet.path: OUT/heterofl``); each client's subnet is cut
from its supernet, BN-recalibrated on the server's public pool, and tested on the client's own
test split with no local training (``bench/weight_sharing.py``'s ``_test_accuracy``).

Run: ``python bench/federated_supernet.py --compare runs/headline [--tag cifar10]``; writes
``bench/results/federated_supernet_<tag>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from rafl.config import AlgorithmConfig  # noqa: E402
from rafl.io import atomic_write_json, atomic_write_text  # noqa: E402
from rafl.stages.compare import load_compare_resume  # noqa: E402
from rafl.stages.prepare import prepare  # noqa: E402

from weight_sharing import _test_accuracy  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", type=Path, required=True, help="a rafl compare output with a heterofl run")
    ap.add_argument("--tag", default="cifar10")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    run_dir = args.compare / "heterofl"
    if not (run_dir / "supernet.safetensors").is_file():
        raise SystemExit(f"{run_dir}: no federated supernet (supernet.safetensors); run heterofl in the comparison")
    cfg, _, _, _ = load_compare_resume(args.compare)
    cfg = cfg.model_copy(deep=True)
    cfg.algorithm = AlgorithmConfig(name="standalone")  # any method: only the clients' subnets are built and tested
    t0 = time.perf_counter()
    before_prep = prepare(cfg, progress=False)
    before = _test_accuracy(before_prep)
    after_cfg = cfg.model_copy(deep=True)
    after_cfg.supernet.path = str(run_dir)
    after_prep = prepare(after_cfg, progress=False)
    after = _test_accuracy(after_prep)
    seconds = time.perf_counter() - t0
    archs = {w: {p: v["arch"] for p, v in prep.extra["profiles"].items()}
             for w, prep in (("before", before_prep), ("after", after_prep))}
    search_acc = {w: {p: v["search_accuracy"] for p, v in prep.extra["profiles"].items()}
                  for w, prep in (("before", before_prep), ("after", after_prep))}
    rounds = len((run_dir / "metrics.jsonl").read_text().splitlines())
    profs = list(archs["before"])
    lines = [f"# The federated supernet searched again ({args.tag})", "",
             f"`python bench/federated_supernet.py --compare {args.compare} --tag {args.tag}` ({seconds:.0f} s, "
             "1 torch thread, measuring in forked workers)", "",
             f"Before: the pretrained supernet (`{cfg.supernet.path}`). After: the global model of `{run_dir}` "
             f"({rounds} rounds of heterofl). The same search config and seed for both ({cfg.search.predictor_samples} "
             f"predictor subnets on the supernet's server-val split, population {cfg.search.population} x "
             f"{cfg.search.generations} generations, top-{cfg.search.top_k} re-measured). Accuracy: every client's "
             "subnet, cut from its supernet and BN-recalibrated on the public pool, no local training, on the "
             "client's own test split; mean over clients (over a tier's clients).", "",
             "| supernet | overall | " + " | ".join(profs) + " |", "|---|---|" + "---|" * len(profs)]
    for which, acc in (("before", before), ("after", after)):
        lines.append(f"| {which} | {acc['overall']:.4f} | " + " | ".join(f"{acc.get(p, float('nan')):.4f}"
                                                                       for p in profs) + " |")
    lines += ["", f"after - before (overall): {after['overall'] - before['overall']:+.4f}", "",
              "| profile | subnet before (server-val acc) | subnet after (server-val acc) |", "|---|---|---|"]
    for p in profs:
        b, a = archs["before"][p].replace("|", "\\|"), archs["after"][p].replace("|", "\\|")
        sb, sa = search_acc["before"][p], search_acc["after"][p]
        lines.append(f"| {p} | `{b}` ({sb:.4f}) | `{a}` ({sa:.4f}) |")
    out = ROOT / "bench" / "results" / f"federated_supernet_{args.tag}"
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    atomic_write_json(out.with_suffix(".json"), {"before": before, "after": after, "archs": archs,
                                                 "search_accuracy": search_acc, "seconds": seconds,
                                                 "compare": str(args.compare), "rounds": rounds})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
