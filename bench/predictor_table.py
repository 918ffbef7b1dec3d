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
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rafl.errors import UserInputError  # noqa: E402
from rafl.io import atomic_write_json  # noqa: E402
from rafl.search.estimators import (MeasuredAccuracy, measurement_cache_dir, sample_across_space,  # noqa: E402
                                    supernet_fingerprint)
from rafl.search.evolution import SearchConfig, search_subnets  # noqa: E402
from rafl.search.genome import Population  # noqa: E402
from rafl.search.predictor import kendall_tau, train_predictor  # noqa: E402
from rafl.search.profile import load_profile, profiles_dir  # noqa: E402
from rafl.stages.search import load_search_supernet, server_dataset, server_eval_data  # noqa: E402
from rafl.supernet.pretrained import (CALIBRATION_NAME, MEASUREMENTS_NAME, is_pretrained_name,  # noqa: E402
                                      pretrained_path, save_calibration)
from rafl.supernet.server_data import calibration_sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--supernet", required=True, help="a shipped name (cifar10) or a supernet folder")
    ap.add_argument("--data-root", default=None, help="where the supernet's dataset is (as for rafl search)")
    ap.add_argument("--samples", type=int, default=SearchConfig().predictor_samples,
                    help="predictor subnets to measure (rafl search's --predictor-samples default)")
    ap.add_argument("--seed", type=int, default=0, help="rafl search's --seed (the predictor's sample)")
    ap.add_argument("--workers", type=int, default=None, help="measuring processes (default: the CPU cores)")
    ap.add_argument("--profiles", default="all",
                    help="comma-separated shipped profiles whose finalists to measure too ('all', or 'none')")
    ap.add_argument("--out", type=Path, default=None, help="default: SUPERNET/measurements.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    folder = pretrained_path(args.supernet) if is_pretrained_name(args.supernet) else Path(args.supernet)
    out = args.out or folder / MEASUREMENTS_NAME
    supernet, meta = load_search_supernet(folder, progress=False)
    config = dict(meta.get("config") or {})
    if args.data_root is not None:
        config["data_root"] = args.data_root
    val, calib, data_info = server_eval_data(config, supernet.space, progress=True)
    print(f"server-val: {data_info['n_val']} images (val_fraction {data_info['val_fraction']} of the "
          f"{data_info['dataset']} public pool, recorded in {folder / 'supernet.json'})", flush=True)
    scfg = SearchConfig(seed=args.seed, workers=args.workers)
    measured = MeasuredAccuracy(supernet, val, calib, batch_size=scfg.batch_size, calib_batches=scfg.calib_batches,
                                cache_dir=measurement_cache_dir(), workers=scfg.workers)
    # a cache written before the halves were recorded: measure those archs again
    for key in [k for k in measured.cache if k not in measured.halves]:
        del measured.cache[key]
    space = supernet.space
    archs = sample_across_space(space, args.samples, args.seed)
    t1 = time.perf_counter()
    # in blocks, in the sample's order: a run stopped early leaves a prefix measured, which is the
    # sample of a smaller --samples (sample_across_space is prefix-stable); the cache keeps it
    for start in range(0, len(archs), 24):
        measured.measure(archs[: start + 24], progress=True,
                         desc=f"measuring the predictor's subnets {start + 1}-{min(start + 24, len(archs))}")
    acc = measured.measure(archs)
    t_measure = time.perf_counter() - t1
    x = Population.from_archs(space, archs).encode()
    _, fit = train_predictor(x, acc, folds=scfg.predictor_folds, hidden=scfg.predictor_hidden,
                             epochs=scfg.predictor_epochs, seed=args.seed)
    keys = [a.canonical(space).to_string() for a in archs]
    halves = np.asarray([measured.halves[k] for k in keys])
    ceiling = kendall_tau(halves[:, 0], halves[:, 1])
    print(f"predictor: Kendall tau {fit.kendall_tau:.3f} ({fit.folds}-fold CV over {len(archs)} subnets); "
          f"split-half noise ceiling: tau {ceiling:.3f} between two halves of server-val "
          f"({int(measured.half_a.sum())} / {int((~measured.half_a).sum())} images)", flush=True)

    names = ([p.stem for p in sorted(profiles_dir().glob("*.yaml"))] if args.profiles == "all"
             else [] if args.profiles == "none" else args.profiles.split(","))
    finalists: dict[str, list[str]] = {}
    for name in names:  # each alone: a profile's finalists do not depend on the other profiles searched
        try:
            res = search_subnets(supernet, [load_profile(name)], val, calib,
                                 SearchConfig(seed=args.seed, predictor_samples=args.samples, workers=args.workers))
        except UserInputError as err:  # a profile no subnet of this space fits (e.g. mcu)
            print(f"{name}: no finalists ({err.message})", flush=True)
            continue
        finalists[name] = [t["arch"] for t in res[name].top_k]
        print(f"{name}: {res[name].arch.to_string()} acc {res[name].accuracy:.4f}", flush=True)
    measured._load_cache()  # the searches' measurements (same cache file)

    table = {k: measured.cache[k] for k in keys}
    for ks in finalists.values():
        for k in ks:
            table.setdefault(k, measured.cache[k])
    # the BN-calibration images rafl search uses (the first calib_batches x batch_size of pool-train in
    # its fixed order), stored pixels: a search on the table recalibrates the picked subnets without data
    ds, split, _ = server_dataset(config, space, progress=False)
    order = calibration_sample(split.pool_train, len(split.pool_train))[: scfg.calib_batches * scfg.batch_size]
    images = ds.images.take(order)
    if not torch.equal(images[...], calib[: len(order)]):
        raise SystemExit("the stored calibration pixels do not reproduce the calibration images")
    cal_path = out.parent / CALIBRATION_NAME
    save_calibration(cal_path, images.pixels, images.mean, images.std)
    weights = folder / "supernet.safetensors"
    doc = {
        "format": "rafl-measurements/1",
        "note": "top-1 (fraction) on the supernet's server-val split after BN recalibration on pool-train "
                "(rafl search's measurement), per canonical arch",
        "supernet_sha256": hashlib.sha256(weights.read_bytes()).hexdigest() if weights.is_file() else None,
        "supernet_fingerprint": supernet_fingerprint(supernet),
        "data": data_info,
        "measurement": {"batch_size": scfg.batch_size, "calib_batches": scfg.calib_batches},
        "calibration": {"file": CALIBRATION_NAME, "sha256": hashlib.sha256(cal_path.read_bytes()).hexdigest(),
                        "n": len(order)},
        "predictor_samples": {"n": len(archs), "seed": args.seed, "archs": keys},
        "finalists": finalists,
        "predictor_fit": fit.to_dict(),
        "noise_ceiling": {"kendall_tau_halves": ceiling, "half_sizes": [int(measured.half_a.sum()),
                                                                         int((~measured.half_a).sum())],
                          "note": "Kendall tau between the accuracies of the predictor's subnets on two fixed "
                                  "random halves of server-val (the same predictions split in two)"},
        "accuracy": table,
        "halves": {k: list(measured.halves[k]) for k in table},
        "made_by": {"command": " ".join(["python", "bench/predictor_table.py", *sys.argv[1:]]),
                    "torch": torch.__version__, "machine": platform.machine(),
                    "seconds": round(time.perf_counter() - t0, 1), "measure_seconds": round(t_measure, 1)},
    }
    atomic_write_json(out, doc)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(f"wrote {out} ({len(table)} subnets); SHA-256 {digest}")
    print("register it in rafl/supernet/pretrained.py: PRETRAINED_MEASUREMENTS")


if __name__ == "__main__":
    main()
