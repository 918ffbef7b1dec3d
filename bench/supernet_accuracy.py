"""Accuracy of the supernet's smallest / middle / largest subnets after progressive shrinking.

    python bench/supernet_accuracy.py                       # digits, the quickstart's default budget
    python bench/supernet_accuracy.py --dataset cifar10 --data-root /work/shared/data/cifar10-jpeg.tar.gz \
        --preset cifar10-30min                              # CIFAR-10 sized for ~30 min of a 2-core CPU

Trains with :func:`rafl.supernet.train.train_supernet` into a temp folder, then prints the test
accuracy (BN recalibrated on pool-train) on held-out data the supernet never saw (see the
``test on`` line), the wall time, and the ratio of the wall time to a baseline measured in the same
process (one epoch of plain SGD on the largest static subnet), so numbers from a loaded machine
stay comparable. Output also goes to bench/results/supernet_accuracy_<dataset>.txt.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

PRESETS = {
    # the quickstart budget (TrainConfig defaults)
    "default": {},
    # CIFAR-10 on a 2-core CPU in ~30 min: 24..32 px inputs, 10% of the data (6,000 images) as the public pool
    "cifar10-30min": {"resolutions": (24, 28, 32), "width_mult": 0.35, "public_fraction": 0.1,
                      "epochs_full": 4, "epochs_kernel": 1, "epochs_depth": 1, "epochs_expand": 2,
                      "batch_size": 128, "lr_full": 0.1, "lr_kernel": 0.03, "lr_depth": 0.03,
                      "lr_expand": 0.03},
}


def _baseline_seconds(cfg) -> float:
    """One epoch of plain SGD (no supernet) on the largest static subnet: the in-process yardstick."""
    from rafl.data import load_dataset
    from rafl.supernet import build_supernet, extract_subnet
    from rafl.supernet.server_data import server_split

    ds = load_dataset(cfg.dataset, cfg.data_root, resolution=cfg.image_size, limit_per_class=cfg.limit_per_class)
    split = server_split(ds, cfg.public_fraction, cfg.public_seed, cfg.val_fraction, cfg.test_samples)
    space = cfg.space(ds.num_classes)
    sub = extract_subnet(build_supernet(space), space.largest()).train()
    opt = torch.optim.SGD(sub.parameters(), lr=0.01, momentum=0.9)
    x_all, y_all = ds.images[split.pool_train], ds.labels[split.pool_train]
    t0 = time.perf_counter()
    for i in range(0, len(y_all), cfg.batch_size):
        opt.zero_grad()
        F.cross_entropy(sub(x_all[i:i + cfg.batch_size]), y_all[i:i + cfg.batch_size]).backward()
        opt.step()
    return time.perf_counter() - t0


def main() -> None:
    from rafl.io import atomic_write_text
    from rafl.supernet.train import TrainConfig, train_supernet

    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="digits")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None, help="results file [bench/results/supernet_accuracy_<dataset>.txt]")
    ap.add_argument("--run-dir", default=None, help="keep the training run here (default: a temp folder)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = TrainConfig(dataset=args.dataset, data_root=args.data_root, **PRESETS[args.preset])
    base = _baseline_seconds(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        _, metrics = train_supernet(cfg, Path(args.run_dir or Path(tmp) / "run"), progress=True)
        wall = time.perf_counter() - t0
    lines = [f"# bench/supernet_accuracy.py --dataset {args.dataset} --preset {args.preset}  torch {torch.__version__}"
             f"  {platform.machine()}  threads={torch.get_num_threads()}",
             f"config: {json.dumps(json.loads(cfg.model_dump_json()))}",
             f"pool-train {metrics['n_pool_train']} samples, server-val {metrics['n_pool_val']}; "
             f"test on {metrics['test_source']}",
             f"{'subnet':<9} {'test acc':>9}  arch"]
    for which in ("smallest", "middle", "largest"):
        lines.append(f"{which:<9} {100 * metrics['test'][which]:>8.2f}%  {metrics['archs'][which]}")
    for phase in metrics["phases"]:
        last = phase["epochs"][-1]
        lines.append(f"phase {phase['phase']:<7} epochs {len(phase['epochs'])}  train acc {last['train_acc']:.3f}  "
                     f"server-val smallest {last.get('val_acc_smallest', float('nan')):.3f}  "
                     f"largest {last.get('val_acc_largest', float('nan')):.3f}")
    lines.append(f"wall {wall:.1f} s = {wall / base:.1f} x baseline (one plain-SGD epoch of the largest "
                 f"static subnet: {base:.2f} s, same process)")
    text = "\n".join(lines)
    print(text)
    out = args.out or str(Path(__file__).parent / "results" / f"supernet_accuracy_{args.dataset}.txt")
    atomic_write_text(out, text + "\n")


if __name__ == "__main__":
    main()
