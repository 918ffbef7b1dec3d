"""Re-score a finished HeteroFL / FedRolex run's final global model with static BN's server
statistics (``sbn_statistics: server``) beside the statistics it was trained with.

For one method of a ``rafl compare`` output (``OUT/METHOD/checkpoint.safetensors``), every device
tier's deployed slice of the final global model is scored on the held-out global test set twice:
with the BN statistics the run deployed (averaged with the weights, ``static_bn: false``) and with
statistics recalibrated on the server's public pool
(:meth:`rafl.federation.algorithms.heterofl.HeteroFL.server_bn_statistics`). The weights are the
same; only the statistics differ. (A run with ``static_bn: true, sbn_statistics: server`` trains
nearly the same weights: training normalizes by batch statistics either way, but its uploads hold
no statistics, so ``norm_clip`` clips slightly different update norms.)

Run: ``python bench/fair_headline.py ...`` first, then
``python bench/rescore_sbn.py runs/headline-fair/seed0-heterofl [--method heterofl]``; it prints a
table and writes ``bench/results/rescore_sbn_<folder>.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rafl.config import AlgorithmConfig
from rafl.federation.algorithms.heterofl import index_map
from rafl.federation.engine import CHECKPOINT
from rafl.federation.store import load_state
from rafl.federation.training import evaluate_accuracy
from rafl.federation.weight_sharing import extract
from rafl.models.sliced import set_scalers
from rafl.stages.compare import load_compare_resume
from rafl.stages.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a rafl compare output folder")
    ap.add_argument("--method", default=None, help="heterofl or fedrolex (default: the folder's one such method)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, hparams, _, _ = load_compare_resume(args.out)
    methods = [m for m in hparams if m in ("heterofl", "fedrolex")]
    method = args.method or (methods[0] if len(methods) == 1 else None)
    if method not in methods:
        raise SystemExit(f"{args.out}: --method must be one of {methods}")
    ck = load_state(args.out / method / CHECKPOINT)
    state, rnd = ck["server_state"], int(ck["round"])
    c = cfg.model_copy(deep=True)
    c.algorithm = AlgorithmConfig(name=method, **{**hparams[method], "static_bn": True, "sbn_statistics": "server"})
    fed = prepare(c, progress=False).federation
    algo = fed.algorithm
    server_stats = algo.server_bn_statistics(state["global"], state["layout"], rnd + 1, fed.server)
    rows, per_tier = [], {}
    for info in fed.clients:
        if info.model_key in per_tier:
            per_tier[info.model_key][1] += 1
            continue
        index = index_map(state["layout"], info, rnd + 1, algo.rolling)
        model = fed.server.make_model(arch=info.arch)
        set_scalers(model, bool(hparams[method]["scaler"]))
        model.load_state_dict(extract(state["global"], index), strict=False)  # as deployed: averaged statistics
        deployed = evaluate_accuracy(model, fed.global_test)
        model.load_state_dict(server_stats[info.model_key], strict=False)
        recal = evaluate_accuracy(model, fed.global_test)
        per_tier[info.model_key] = [info.profile, 1, deployed[0] / deployed[1], recal[0] / recal[1]]
    n = sum(v[1] for v in per_tier.values())
    lines = [f"# {method}'s final global model (`{args.out}`, round {rnd}) re-scored with server BN statistics", "",
             "Global protocol (held-out balanced test set); the same weights with the BN statistics the run deployed "
             "and with statistics recalibrated on the server's public pool (`sbn_statistics: server`). Written by "
             f"`python bench/rescore_sbn.py {args.out}`.", "",
             "| tier | clients | deployed statistics | server statistics |", "|---|---|---|---|"]
    for tier, k, a, b in per_tier.values():
        lines.append(f"| {tier} | {k} | {a:.4f} | {b:.4f} |")
        rows.append((k, a, b))
    lines.append(f"| mean over clients | {n} | {sum(k * a for k, a, _ in rows) / n:.4f} | "
                 f"{sum(k * b for k, _, b in rows) / n:.4f} |")
    text = "\n".join(lines) + "\n"
    (ROOT / "bench" / "results" / f"rescore_sbn_{args.out.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
