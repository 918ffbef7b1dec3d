"""Measure the accuracy predictor's training subnets of a supernet, for shipping beside its weights.

    python bench/predictor_table.py --supernet cifar10 --data-root ../shared/data/cifar10-jpeg.tar.gz

Rebuilds the supernet's own server-val split from its recorded training config (``dataset``,
``public_fraction``, ``public_seed``, ``val_fraction``, ...: :func:`rafl.stages.search.server_eval_data`,
exactly what ``rafl search --remeasure`` measures on), measures the ``--samples`` subnets that
``rafl search --predictor-samples N`` trains its predictor on (:func:`sample_across_space`, seed
``--seed``) with ``rafl search``'s measurement (BN recalibrated on pool-train, then top-1 on
server-val), then runs ``rafl search``'s evolution for every shipped device profile with the
predictor trained on them and measures each profile's top-k finalists too, so that
``rafl search --supernet NAME --device-profile P`` with the default options finds every
accuracy it needs in the table.

Writes ``rafl/pretrained/NAME/measurements.json`` (or ``--out``): arch -> accuracy, and per arch
the accuracies on two fixed random halves of server-val (the same predictions, split), the
predictor's cross-validated Kendall tau and the split-half noise ceiling (Kendall tau between the
two halves' accuracies of the same subnets); prints its SHA-256 to register in
``rafl/supernet/pretrained.py`` (``PRETRAINED_MEASUREMENTS``). Measurements go through
``rafl search``'s on-disk cache, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rafl.search.profile import profiles_dir  # noqa: E402
from rafl.stages.search import write_measurements  # noqa: E402
from rafl.supernet.pretrained import MEASUREMENTS_NAME, resolve_supernet, supernet_measurements  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernet", required=True, help="a shipped name (cifar10) or a supernet folder")
    ap.add_argument("--data-root", default=None, help="where the supernet's dataset is (as for rafl search)")
    ap.add_argument("--samples", type=int, default=500, help="predictor subnets to measure (rafl search's "
                                                               "--predictor-samples default without a table)")
    ap.add_argument("--seed", type=int, default=0, help="rafl search's --seed (the predictor's sample)")
    ap.add_argument("--workers", type=int, default=None, help="measuring processes (default: the CPU cores)")
    ap.add_argument("--profiles", default="all",
                    help="comma-separated shipped profiles whose finalists to measure too ('all', or 'none')")
    ap.add_argument("--out", type=Path, default=None, help="default: SUPERNET/measurements.json")
    ap.add_argument("--reuse", action="store_true",
                    help="take the accuracies of the supernet's current measurements.json as measured (same weights "
                         "and measurement): after a change of the search, only its new finalists are measured")
    args = ap.parse_args()
    names = ([p.stem for p in sorted(profiles_dir().glob("*.yaml"))] if args.profiles == "all"
             else [] if args.profiles == "none" else args.profiles.split(","))
    command = " ".join(["python", "bench/predictor_table.py", *sys.argv[1:]])
    doc = write_measurements(args.supernet, data_root=args.data_root, samples=args.samples, seed=args.seed,
                             workers=args.workers, profiles=names, out=args.out, command=command,
                             say=lambda line: print(line, flush=True),
                             reuse=supernet_measurements(resolve_supernet(args.supernet)) if args.reuse else None)
    path = args.out or resolve_supernet(args.supernet) / MEASUREMENTS_NAME
    print(f"wrote {path} ({len(doc['accuracy'])} subnets, {doc['made_by']['seconds']:.0f} s); SHA-256 "
          f"{hashlib.sha256(Path(path).read_bytes()).hexdigest()}")
    print("register it in rafl/supernet/pretrained.py (PRETRAINED_MEASUREMENTS) when it ships")
    fit, ceiling = doc["predictor_fit"], doc["noise_ceiling"]
    acc = doc["accuracy"]
    lines = [f"# Measured subnets of `{args.supernet}` (bench/predictor_table.py)", "",
             f"`{command}`", "",
             f"torch {doc['made_by']['torch']}, {doc['made_by']['machine']}; {doc['made_by']['seconds']:.0f} s "
             "(measurements already in the cache are not measured again)", "",
             f"- server-val: {doc['data']['n_val']} images (`val_fraction` {doc['data']['val_fraction']}, from the "
             "supernet's recorded config); BN recalibrated on "
             f"{doc['calibration']['n']} pool-train images",
             f"- predictor subnets: {doc['predictor_samples']['n']} (seed {doc['predictor_samples']['seed']}); "
             f"accuracy {min(acc.values()):.4f} .. {max(acc.values()):.4f}",
             f"- predictor: Kendall tau **{fit['kendall_tau']:.3f}**, RMSE {fit['rmse']:.4f} ({fit['folds']}-fold "
             "cross-validation)",
             f"- noise ceiling: the same subnets on two halves of server-val ({ceiling['half_sizes'][0]} / "
             f"{ceiling['half_sizes'][1]} images) rank with Kendall tau **{ceiling['kendall_tau_halves']:.3f}** "
             "against each other", "",
             "| profile | finalists (searched alone, default options) | best measured |", "|---|---|---|"]
    for name, ks in doc["finalists"].items():
        best = max(ks, key=lambda k: acc[k]).replace("|", "\\|")  # a table cell: arch strings hold '|'
        lines.append(f"| {name} | {len(ks)} | `{best}` {max(acc[k] for k in ks):.4f} |")
    results = ROOT / "bench" / "results" / f"predictor_table_{Path(args.supernet).name}.md"
    results.write_text("\n".join(lines) + "\n")
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
