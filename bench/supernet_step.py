"""Throughput of one progressive-shrinking step vs a bare PyTorch loop on the same static subnet.

For each of N random subnets (fixed seed) and the same batch, time
  (a) a supernet step: sample the arch, forward through the elastic supernet (rafl Supernet over
      ofa's dynamic layers), cross-entropy, backward, SGD step over the supernet's parameters;
  (b) a bare step: forward/backward/SGD of the same subnet extracted as a static model.
KD is excluded (it costs the same extra forward in both). Timings interleave (a) and (b), take the
median of repeats, and the printed ratio is sum(a) / sum(b) - 1 (target: <= 10% overhead).

    python bench/supernet_step.py [--width-mult 0.35] [--batch 64] [--archs 6] [--repeats 5]
    python bench/supernet_step.py --device cuda --batch 128 --resolutions 24,28,32 --out R.txt

On ``--device cuda`` both steps run as ``rafl supernet train`` runs on CUDA: bf16 autocast,
channels-last inputs and weights, the time of a step measured after ``torch.cuda.synchronize``;
the output adds images/s of both. Writes the output to bench/results/supernet_step.txt (or
``--out``) as well.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rafl.supernet import SearchSpace, build_supernet, extract_subnet

from _timing import median_time  # bench/ is on sys.path when run as a script


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width-mult", type=float, default=0.35)
    ap.add_argument("--resolutions", default="16,20,24")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--archs", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "supernet_step.txt"))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    cl = torch.channels_last if cuda else torch.contiguous_format
    space = SearchSpace(width_mult=args.width_mult, resolutions=tuple(int(r) for r in args.resolutions.split(",")))
    net = build_supernet(space).train().to(dev, memory_format=cl)
    x = torch.randn(args.batch, 3, 32, 32, device=dev).contiguous(memory_format=cl)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    archs = [space.largest(), space.smallest()] + [space.sample(rng) for _ in range(args.archs - 2)]
    opt_super = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9, nesterov=True)
    lines = [f"# bench/supernet_step.py  torch {torch.__version__}  {platform.processor() or platform.machine()}  "
             f"threads={args.threads}  width_mult={args.width_mult}  batch={args.batch}  "
             f"resolutions={space.resolutions}  device={args.device}"
             + (f" ({torch.cuda.get_device_name()}, bf16 autocast, channels_last)" if cuda else ""),
             f"{'arch':<60} {'supernet ms':>12} {'static ms':>10} {'overhead':>9}"]
    total_a = total_b = 0.0
    for arch in archs:
        sub = extract_subnet(net, arch).train().to(dev, memory_format=cl)
        opt_sub = torch.optim.SGD(sub.parameters(), lr=1e-4, momentum=0.9, nesterov=True)
        sample_rng = np.random.default_rng(1)

        def supernet_step(arch=arch):
            space.sample(sample_rng)  # the sampling cost of a real step (the arch timed is fixed)
            opt_super.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(net(x, arch), y)
            loss.backward()
            opt_super.step()
            sync()

        def static_step(sub=sub, opt_sub=opt_sub):
            opt_sub.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=cuda):
                loss = F.cross_entropy(sub(x), y)
            loss.backward()
            opt_sub.step()
            sync()

        supernet_step(), static_step()  # warm-up
        a_times, b_times = [], []
        for _ in range(args.repeats):
            a_times.append(median_time(supernet_step, 1))
            b_times.append(median_time(static_step, 1))
        a, b = statistics.median(a_times), statistics.median(b_times)
        total_a += a
        total_b += b
        name = arch.to_string(space)
        name = name if len(name) <= 60 else name[:57] + "..."
        lines.append(f"{name:<60} {1e3 * a:>12.1f} {1e3 * b:>10.1f} {100 * (a / b - 1):>8.1f}%")
    ratio = total_a / total_b
    lines.append(f"TOTAL supernet/static = {ratio:.3f}  -> overhead {100 * (ratio - 1):.1f}% (target <= 10%)")
    n = len(archs) * args.batch
    lines.append(f"images/s over the {len(archs)} archs: supernet {n / total_a:,.0f}, static subnet {n / total_b:,.0f}")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from rafl.io import atomic_write_text

    atomic_write_text(args.out, text + "\n")


if __name__ == "__main__":
    main()
