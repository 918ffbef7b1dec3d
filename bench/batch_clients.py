"""Clients that share a subnet trained together (issue 60): one program over K clients against
one client after another, on the cross-device workload's training arithmetic.

Workload: ``--clients`` clients (default 50) of ``--images`` images each (default 90, CIFAR-10
sized 3 x 32 x 32, random pixels: only time is measured), round-robin over the shipped ``cifar10``
supernet's three tier subnets (its README's smallest, middle and largest: stand-ins for the proxy
supernet's tiers), one local epoch of SGD (lr 0.05, momentum 0.9) in batches of 32 with
cross-entropy, classifier dropout off, one torch thread. Per tier, the clients of that tier:

* ``one_by_one``: every client its own subnet, one optimizer step after another, batches laid out
  channels-last as rafl's ``prepare_input`` does (the arithmetic of rafl's one-by-one engine,
  without its state files and payloads);
* ``vmap``: ``torch.func.functional_call`` + ``grad`` under ``vmap`` over the tier's stacked
  parameters and BN buffers (:func:`torch.func.stack_module_state`), one batch per client per
  step, SGD with momentum on the stacked tensors. ``vmap`` rejects channels-last inputs
  (``NYI: Tensor.clone(memory_format) inside vmap``), so its convolutions run NCHW: functorch's
  batching rule turns the per-client convolutions into one grouped convolution (groups = K x
  the layer's groups), the same program the grouped-convolution approach writes by hand.

The two alternate ``--repeats`` times in one process (medians of img/s); the ratio is vmap /
one-by-one per repeat. ``--compile`` adds ``torch.compile`` of the one-by-one step (its compile
time is reported separately; it is per architecture and process).

Run: ``OMP_NUM_THREADS=1 python bench/batch_clients.py --out bench/results/batch_clients.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, stack_module_state, vmap

import rafl.supernet.model as supernet_model
from rafl.supernet.arch import ArchConfig
from rafl.supernet.checkpoint import load_supernet
from rafl.supernet.model import extract_subnet, resize_input
from rafl.supernet.pretrained import resolve_supernet

TIERS = {
    "smallest": "r24_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3",
    "middle": "r28_k5e4.k5e4.k5e4|k5e4.k5e4.k5e4|k5e4.k5e4.k5e4|k5e4.k5e4.k5e4|k5e4.k5e4.k5e4",
    "largest": "r32_k7e6.k7e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6|"
               "k7e6.k7e6.k7e6.k7e6",
}
LR, MOMENTUM = 0.05, 0.9


def _models(supernet, arch: ArchConfig, k: int) -> list[torch.nn.Module]:
    models = []
    for _ in range(k):
        m = extract_subnet(supernet, arch).train()
        for mod in m.modules():  # classifier dropout off: the same work in both programs
            if hasattr(mod, "dropout_rate"):
                mod.dropout_rate = 0.0
        models.append(m)
    return models


def one_by_one(models, data, step_fn) -> None:
    """One local epoch of every client, one after the other (``data``: per client (x (N, 3, 32,
    32), y (N,)))."""
    for m, (x, y) in zip(models, data):
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
        for i in range(0, len(y), 32):
            loss = step_fn(m, x[i:i + 32], y[i:i + 32])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()


def batched(models, data) -> None:
    """One local epoch of every client as one program: ``vmap`` over the stacked clients."""
    base = models[0]
    params, buffers = stack_module_state(models)
    mom = {k: torch.zeros_like(v) for k, v in params.items()}

    def loss_fn(p, b, xb, yb):
        return F.cross_entropy(functional_call(base, (p, b), (xb,)), yb)

    step = vmap(grad(loss_fn), randomness="different")
    x = torch.stack([d[0] for d in data])
    y = torch.stack([d[1] for d in data])
    original = supernet_model.prepare_input
    supernet_model.prepare_input = resize_input  # vmap rejects channels-last clones
    try:
        for i in range(0, y.shape[1], 32):
            grads = step(params, buffers, x[:, i:i + 32], y[:, i:i + 32])
            with torch.no_grad():
                for k, p in params.items():
                    mom[k].mul_(MOMENTUM).add_(grads[k])
                    p.sub_(LR * mom[k])
    finally:
        supernet_model.prepare_input = original


def ce_step(m, x, y):
    return F.cross_entropy(m(x), y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--images", type=int, default=90)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiers", default="smallest,middle,largest")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    supernet = load_supernet(resolve_supernet("cifar10"))
    gen = torch.Generator().manual_seed(0)
    tiers = args.tiers.split(",")
    rows = []
    load = [os.getloadavg()[0]]
    for t, name in enumerate(tiers):
        k = len(range(t, args.clients, len(tiers)))
        arch = ArchConfig.from_string(TIERS[name], supernet.space)
        data = [(torch.randn(args.images, 3, 32, 32, generator=gen), torch.randint(0, 10, (args.images,), generator=gen))
                for _ in range(k)]
        variants = {"one_by_one": lambda ms: one_by_one(ms, data, ce_step), "vmap": lambda ms: batched(ms, data)}
        compile_s = None
        if args.compile:
            compiled = torch.compile(ce_step, dynamic=False)
            t0 = time.perf_counter()
            one_by_one(_models(supernet, arch, 1), data[:1], compiled)
            compile_s = time.perf_counter() - t0
            variants["compiled"] = lambda ms: one_by_one(ms, data, compiled)
        rates: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v, fn in variants.items():
                ms = _models(supernet, arch, k)
                t0 = time.perf_counter()
                fn(ms)
                rates[v].append(k * args.images / (time.perf_counter() - t0))
            load.append(os.getloadavg()[0])
        ratio = statistics.median(b / a for a, b in zip(rates["one_by_one"], rates["vmap"]))
        row = {"tier": name, "clients": k, **{v: statistics.median(r) for v, r in rates.items()},
               "vmap_ratio": ratio, "compile_s": compile_s}
        rows.append(row)
        print(row, flush=True)
    cmd = "OMP_NUM_THREADS=1 python bench/batch_clients.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "compile")) + (
        " --compile" if args.compile else "")
    lines = [f"# Clients trained together vs one by one (`{cmd}`)", "",
             f"{args.clients} clients of {args.images} images, round-robin over the shipped cifar10 supernet's tier "
             f"subnets, one local epoch, batch 32, one torch thread; img/s = medians of {args.repeats} alternating "
             f"repeats; load average (1 min) over the run {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores.",
             "", "| tier | clients | one by one img/s | vmap img/s | vmap / one by one |"
             + (" compiled img/s | compile s |" if args.compile else ""),
             "|---|---|---|---|---|" + ("---|---|" if args.compile else "")]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['clients']} | {r['one_by_one']:.0f} | {r['vmap']:.0f} | {r['vmap_ratio']:.2f} |"
                     + (f" {r['compiled']:.0f} | {r['compile_s']:.0f} |" if args.compile else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
