"""Channels-last on the CPU: the shipped CIFAR-10 supernet's subnets, forward and backward, with
rafl's input layout (:func:`rafl.supernet.model.prepare_input` lays CPU batches out
``torch.channels_last``) against the same models fed NCHW (``torch.contiguous_format``), timed in
turn in this process.

Per subnet (the smallest, one sampled with seed 0, the largest): evaluation of ``--images`` images
in batches of 256 (what the global test set costs per client and evaluation round) and ``--steps``
SGD steps of batch 32 (part of a client's local epoch), one torch thread, ``--repeats``
alternating pairs; the ratio is channels-last / NCHW time (below 1: faster), median over the
pairs. Also the supernet's own training step (sampled subnets' forward and backward through the
elastic layers). The logits of both layouts agree to float32 rounding.

Run: ``python bench/channels_last.py [--out bench/results/channels_last.md]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import rafl.supernet.model as model_module
from rafl.supernet import load_supernet
from rafl.supernet.model import extract_subnet


@contextlib.contextmanager
def nchw():
    """rafl's models fed NCHW batches, as before channels-last: the baseline."""
    original = model_module.prepare_input

    def contiguous(x, r):
        return original(x, r).contiguous()

    model_module.prepare_input = contiguous
    try:
        yield
    finally:
        model_module.prepare_input = original


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = load_supernet("cifar10")
    space = net.space
    x = torch.randn(args.images, 3, 32, 32)
    y = torch.randint(0, 10, (args.images,))
    subnets = {"smallest": space.smallest(), "middle": space.sample(np.random.default_rng(0)), "largest": space.largest()}
    rows = []

    def evaluate(m):
        with torch.no_grad():
            for i in range(0, len(x), 256):
                m(x[i:i + 256])

    def train(m):
        opt = torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9)
        m.train()
        for i in range(args.steps):
            loss = torch.nn.functional.cross_entropy(m(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.eval()

    for name, arch in subnets.items():
        sub = extract_subnet(net, arch).eval()
        with torch.no_grad():
            fast = sub(x[:64])
            with nchw():
                slow = sub(x[:64])
        diff = float((fast - slow).abs().max())
        for what, fn in (("evaluate", evaluate), ("train", train)):
            fn(sub)  # warm-up, both layouts
            with nchw():
                fn(sub)
            pairs = []
            for _ in range(args.repeats):
                with nchw():
                    base = timed(lambda: fn(sub))
                pairs.append((timed(lambda: fn(sub)), base))
            cl, base = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
            rows.append((name, arch.to_string(space), what, base, cl, statistics.median(a / b for a, b in pairs), diff))
    rng = np.random.default_rng(1)
    archs = [space.sample(rng) for _ in range(args.steps)]

    def supernet_step():
        opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)
        net.train()
        for i, a in enumerate(archs):
            loss = torch.nn.functional.cross_entropy(net(x[i * 32:(i + 1) * 32], a), y[i * 32:(i + 1) * 32])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()

    supernet_step()
    pairs = []
    for _ in range(args.repeats):
        with nchw():
            base = timed(supernet_step)
        pairs.append((timed(supernet_step), base))
    rows.append(("supernet", f"{args.steps} sampled subnets", "train", statistics.median(p[1] for p in pairs),
                 statistics.median(p[0] for p in pairs), statistics.median(a / b for a, b in pairs), float("nan")))
    lines = ["# Channels-last on the CPU: rafl's layout vs NCHW", "",
             f"Shipped CIFAR-10 supernet, one torch thread, {args.repeats} alternating pairs (median); evaluate: "
             f"{args.images} images in batches of 256; train: {args.steps} SGD steps of batch 32. Written by "
             "`python bench/channels_last.py`.", "",
             "| subnet | arch | work | NCHW s | channels-last s | ratio | max logit diff |", "|---|---|---|---|---|---|---|"]
    for name, arch, what, base, cl, ratio, diff in rows:
        arch = arch.replace("|", "\\|")
        lines.append(f"| {name} | `{arch}` | {what} | {base:.2f} | {cl:.2f} | {ratio:.2f}x | {diff:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
