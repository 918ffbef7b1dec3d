"""Package a finished `rafl supernet train` run as a shipped pretrained supernet (float16 weights).

    python bench/pack_pretrained.py --run runs/cifar10-supernet --name cifar10 \
        --command "rafl supernet train --preset cifar10 --data-root ../shared/data/cifar10-jpeg.tar.gz --out runs/cifar10-supernet"

Writes rafl/pretrained/NAME/ (supernet.safetensors in float16 with float32 BN statistics,
supernet.json, config.json, metrics.json, README.md) and bench/results/supernet_NAME.md: the
test accuracy of the smallest / middle / largest subnets (BN recalibrated on pool-train, as the
training's final table) for the float32 run and the float16 package, measured here back to back,
and the training curve (server-val accuracy per phase). Prints the SHA-256 to register in
rafl/supernet/pretrained.py (PRETRAINED).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as st_save

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rafl.data import load_dataset  # noqa: E402
from rafl.supernet.checkpoint import FORMAT, META_NAME, WEIGHTS_NAME, load_meta, load_supernet  # noqa: E402
from rafl.supernet.pretrained import PRETRAINED_DIR, half_state  # noqa: E402
from rafl.supernet.server_data import calibration_sample, server_split  # noqa: E402
from rafl.supernet.train import TrainConfig, evaluate_subnet  # noqa: E402


def accuracies(net, space, cfg: TrainConfig, ds, split) -> dict[str, float]:
    train_x = ds.images.take(split.pool_train)
    idx = torch.as_tensor(calibration_sample(np.arange(len(split.pool_train)), cfg.recal_batches * cfg.batch_size,
                                             cfg.seed))
    calib = [train_x[idx[i:i + cfg.batch_size]] for i in range(0, len(idx), cfg.batch_size)]
    test_x, test_y = ds.images[split.test], ds.labels[split.test]
    return {w: evaluate_subnet(net, a, test_x, test_y, calib, cfg.eval_batch_size)
            for w, a in (("smallest", space.smallest()), ("middle", space.middle()), ("largest", space.largest()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--command", required=True, help="the exact training command, recorded in the README")
    ap.add_argument("--wall", default="", help="training wall time, recorded in the README")
    args = ap.parse_args()

    meta = load_meta(args.run)
    cfg = TrainConfig(**meta["config"])
    net = load_supernet(args.run)
    space = net.space
    ds = load_dataset(cfg.dataset, cfg.data_root, resolution=cfg.image_size, limit_per_class=cfg.limit_per_class,
                      progress=False)
    split = server_split(ds, cfg.public_fraction, cfg.public_seed, cfg.val_fraction, cfg.test_samples)
    fp32 = accuracies(net, space, cfg, ds, split)

    out = PRETRAINED_DIR / args.name
    out.mkdir(parents=True, exist_ok=True)
    state = half_state({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()})
    data = st_save(state, metadata={"format": FORMAT, "storage": "float16 weights, float32 BN statistics"})
    (out / WEIGHTS_NAME).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    packed_meta = {**meta, "weights_sha256": digest, "weights_bytes": len(data), "weights_dtype": "float16"}
    packed_meta["metrics"] = {**meta["metrics"], "test_float32_run": meta["metrics"].get("test"), "test": None}
    packed_meta["config"] = {**meta["config"], "data_root": None}  # the machine's path is not part of the recipe
    (out / META_NAME).write_text(json.dumps(packed_meta, indent=1))
    (out / "config.json").write_text(json.dumps(packed_meta["config"], indent=1))

    # the package as a user loads it (float16 -> float32 supernet)
    from rafl.supernet.checkpoint import _parse_safetensors, load_state_into
    from rafl.supernet.model import build_supernet

    packed = load_state_into(build_supernet(space), _parse_safetensors(data, out / WEIGHTS_NAME), out).eval()
    fp16 = accuracies(packed, space, cfg, ds, split)
    packed_meta["metrics"]["test"] = fp16  # what `rafl supernet info NAME` reports: the shipped weights
    (out / META_NAME).write_text(json.dumps(packed_meta, indent=1))
    (out / "metrics.json").write_text(json.dumps(packed_meta["metrics"], indent=1))

    lines = [f"# Pretrained supernet `{args.name}` (bench/pack_pretrained.py)", "",
             f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} thread(s); "
             f"test: {meta['metrics'].get('test_source')}; BN recalibrated on {cfg.recal_batches} pool-train batches", "",
             "| subnet | arch | test acc float32 (training run) | test acc float16 (shipped) |", "|---|---|---|---|"]
    for w in ("smallest", "middle", "largest"):
        lines.append(f"| {w} | `{meta['metrics']['archs'][w]}` | {100 * fp32[w]:.2f}% | {100 * fp16[w]:.2f}% |")
    lines += ["", f"weights: {len(data) / 2**20:.2f} MiB float16 (float32: {meta['weights_bytes'] / 2**20:.2f} MiB); "
              f"SHA-256 {digest}", "", "## Training curve (server-val, BN recalibrated, end of each epoch's phase)", "",
              "| phase | epoch | train loss | train acc | val smallest | val largest | seconds |", "|---|---|---|---|---|---|---|"]
    for phase in meta["metrics"]["phases"]:
        for e in phase["epochs"]:
            lines.append(f"| {phase['phase']} | {e['epoch']} | {e['train_loss']:.3f} | {e['train_acc']:.3f} | "
                         f"{e.get('val_acc_smallest', float('nan')):.3f} | {e.get('val_acc_largest', float('nan')):.3f} | "
                         f"{e['seconds']:.0f} |")
    report = "\n".join(lines) + "\n"
    (ROOT / "bench" / "results" / f"supernet_{args.name}.md").write_text(report)
    readme = [f"# The shipped `{args.name}` supernet", "",
              f"Load it by name: `rafl search --supernet {args.name}`, `supernet: {args.name}` in a run config, "
              f"`rafl supernet info {args.name}`.", "",
              "Made by (seed in config.json: "
              f"{cfg.seed}; 2-core CPU{', ' + args.wall if args.wall else ''}):", "", f"    {args.command}", "",
              f"then `python bench/pack_pretrained.py --run RUN --name {args.name} --command ...` (float16 weights).",
              "Retrain with the same command and compare your metrics.json with this folder's.", "", report]
    (out / "README.md").write_text("\n".join(readme))
    print(report)
    print(f'register in rafl/supernet/pretrained.py: PRETRAINED["{args.name}"] = "{digest}"')


if __name__ == "__main__":
    main()
