"""Speed of rafl's data path against the plain PyTorch / decode-every-time baselines, in one process.

(1) Loader: one epoch over a client's training indices with ``rafl.data.make_loader`` (one tensor
    gather per batch) vs the usual ``DataLoader(Subset(TensorDataset(images, labels), idx),
    shuffle=True)`` (per-sample ``__getitem__`` + ``default_collate``), same batch size, same data.
(2) Dataset load: ``load_dataset("cifar10", tarball)`` from the uint8 cache vs decoding the JPEGs
    again (a fresh cache dir), on ``--limit-per-class`` images per class and split of the shared
    CIFAR-10 (skipped with a note when the tarball is absent).

Prints the timings and the speed-up ratios baseline / rafl (target: > 1 for both).

    python bench/data_loader.py [--batch 64] [--repeats 5] [--limit-per-class 500]
Writes the output to bench/results/data_loader.txt as well.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from rafl.data import load_dataset, make_loader, make_partition

from _timing import median_time  # bench/ is on sys.path when run as a script

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpeg.tar.gz"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit-per-class", type=int, default=500)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lines = [f"# bench/data_loader.py  (python {platform.python_version()}, torch {torch.__version__}, "
             f"{os.cpu_count()} cpus, 1 thread)"]

    ds = load_dataset("digits")
    part = make_partition(ds.labels.numpy(), "iid", 2, seed=0)
    idx = part.clients[0].train
    plain = DataLoader(Subset(TensorDataset(ds.images[:], ds.labels), idx.tolist()), batch_size=args.batch,
                       shuffle=True, generator=torch.Generator().manual_seed(0))
    ours = make_loader(ds, idx, args.batch, shuffle=True, seed=0)

    def epoch(loader):
        n = 0
        for x, y in loader:
            n += int(y.numel())
        assert n == len(idx)

    t_plain = median_time(lambda: epoch(plain), args.repeats)
    t_ours = median_time(lambda: epoch(ours), args.repeats)
    lines.append(f"loader, digits 3x32x32, {len(idx)} samples, batch {args.batch}: "
                 f"DataLoader(Subset(TensorDataset)) {t_plain * 1e3:.1f} ms/epoch, make_loader {t_ours * 1e3:.1f} "
                 f"ms/epoch, speed-up {t_plain / t_ours:.1f}x")

    if SHARED.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["RAFL_CACHE_DIR"] = tmp
            t0 = time.perf_counter()
            first = load_dataset("cifar10", SHARED, limit_per_class=args.limit_per_class)
            t_decode = time.perf_counter() - t0
            t_cached = median_time(
                lambda: load_dataset("cifar10", SHARED, limit_per_class=args.limit_per_class), args.repeats)
            lines.append(f"cifar10 load, {len(first)} images (limit {args.limit_per_class}/class/split): "
                         f"decode from tarball {t_decode:.2f} s, from uint8 cache {t_cached:.2f} s, "
                         f"speed-up {t_decode / t_cached:.1f}x")
    else:
        lines.append(f"cifar10 load: skipped ({SHARED} not found)")

    text = "\n".join(lines)
    print(text)
    out = Path(__file__).resolve().parent / "results" / "data_loader.txt"
    from rafl.io import atomic_write_text

    atomic_write_text(out, text + "\n")


if __name__ == "__main__":
    np.random.seed(0)
    main()
