"""Where a deployed model's BatchNorm statistics should come from (issue 56, item 6), measured on
finished runs: every client's final model of a ``rafl compare`` output re-scored under each
deployment policy of ``train.bn_statistics`` (:mod:`rafl.federation.bn_statistics`).

``client`` (re-estimated on the client's own training split) and ``server`` (re-estimated on the
server pool's 512 calibration images) act only when a model is deployed -- around evaluation, not in
training -- so the same trained weights scored under each of them is exactly what a run with that
policy reports: no retraining. ``local`` (FedBN) changes the client steps and needs its own run; it
is not re-scored here. Each row is one method's run (its own rule in the first column, as its
summary says), every client evaluated as the engine does at the last round (the personalized
protocol on the client's test split and the global protocol on the held-out balanced test set),
paired differences over clients with the 95 % Student's t half-width (:mod:`rafl.reports.stats`).

Run: ``python bench/bn_policy_rescore.py runs/where-federation-pays/pool5000-pc90/standalone ...``
(one or more ``rafl compare`` folders, one method each, finished; ``--max-clients N`` scores a seeded
sample of N trained clients, for the 500-client cells); writes
``bench/results/bn_policy_rescore.md`` / ``.json`` (``--results``) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from rafl.federation.bn_statistics import apply_policy
from rafl.federation.engine import Engine
from rafl.models import resolve_models
from rafl.reports.stats import format_points, paired_interval
from rafl.stages.compare import load_compare_resume
from rafl.stages.compare.methods import method_builder
from rafl.stages.prepare import engine_config

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("client", "server")
#: the evaluation contract's keys of the two protocols (correct / total per client)
PROTOCOLS = (("model", "personalized"), ("model@global", "global"))


def rescore(folder: Path, max_clients: int | None = None) -> dict:
    """``{"method", "own", "round", "clients", "acc": {policy: {protocol: {client: accuracy}}}}`` of the
    one-method comparison in ``folder`` (its final round's client states, re-evaluated per policy);
    ``max_clients``: at most this many of the clients that trained, drawn without replacement by
    ``random.Random(0)`` (the same ones under every policy), else every client the engine evaluates
    one by one."""
    cfg, hparams, models, feature_dim = load_compare_resume(folder)
    if len(hparams) != 1:
        raise SystemExit(f"{folder}: holds {len(hparams)} methods; allowed: a one-method rafl compare folder")
    method = next(iter(hparams))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    policy = cfg.train.bn_statistics
    cfg.train.bn_statistics = "server"  # built so that the server's pool is kept (a run keeps only what it reads)
    fed, _, _ = method_builder(cfg, hparams, resolve_models(models), feature_dim, False, False)(method)
    own = policy if policy is not None else fed.algorithm.deployed_bn_statistics()
    ecfg = engine_config(cfg)
    ecfg.workers = 1
    engine = Engine(fed, ecfg, folder / method, progress=False)
    try:
        state, start = engine._start(resume=True)  # the checkpoint: the final broadcast and committed clients
        rnd = start - 1
        acc: dict[str, dict[str, dict[str, float]]] = {}
        for policy in POLICIES:
            apply_policy(fed, policy)
            t0 = time.time()
            if max_clients is None:
                _, per_client = engine._evaluate(rnd, state.broadcast)
            else:
                trained = [cid for cid in range(len(fed.clients)) if engine.store.has(cid)]
                ids = sorted(random.Random(0).sample(trained, min(max_clients, len(trained))))
                per_client, _ = engine.clients.evaluate(rnd, ids, state.broadcast)
            acc[policy] = {name: {str(c): r[f"{key}.correct"] / r[f"{key}.total"] for c, r in per_client.items()
                                  if r.get(f"{key}.total")} for key, name in PROTOCOLS}
            print(f"  {folder.name} under {policy}: {len(per_client)} clients in {time.time() - t0:.0f} s", flush=True)
    finally:
        engine.clients.close()
    return {"folder": str(folder), "method": method, "own": own, "round": rnd, "acc": acc}


def render(results: list[dict], command: str) -> str:
    lines = ["# BatchNorm statistics of deployed models: client vs server, same weights", "",
             f"Command: `{command}`. Each run's final client states re-scored under `train.bn_statistics` "
             "`client` (re-estimated on the client's own training split) and `server` (on the server pool's 512 "
             "calibration images); the weights are the run's, only the statistics differ. Mean accuracy over the "
             "clients the engine evaluates one by one (trained clients; with --max-clients N, N of them drawn with "
             "seed 0); difference server − client paired over "
             "them, points, ± the 95 % Student's t half-width; `*` where it excludes 0.", "",
             "| run | method | own rule | clients | personalized: client | server | server − client | "
             "global: client | server | server − client |", "|" + "---|" * 10]
    for r in results:
        cells = []
        for _, name in PROTOCOLS:
            a, b = r["acc"]["client"][name], r["acc"]["server"][name]
            iv = paired_interval(b, a)
            cells += [f"{sum(a.values()) / len(a):.3f}" if a else "-", f"{sum(b.values()) / len(b):.3f}" if b else "-",
                      format_points(iv) if iv.n else "-"]
        n = len(r["acc"]["client"]["personalized"])
        lines.append(f"| `{Path(r['folder']).parent.name}/{Path(r['folder']).name}` | {r['method']} | {r['own']} | {n} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="finished one-method rafl compare folders")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--max-clients", type=int, default=None, metavar="N",
                    help="score N of the trained clients (drawn with seed 0; every global scoring costs ~3 s)")
    args = ap.parse_args(argv)
    if args.max_clients is not None and args.max_clients < 2:
        print(f"error: --max-clients {args.max_clients}; allowed: an integer >= 2 (a t interval)", file=sys.stderr)
        return 2
    missing = [str(f) for f in args.folders if not (f / "compare.json").is_file()]
    if missing:
        print(f"error: not a finished rafl compare folder (no compare.json): {', '.join(missing)}", file=sys.stderr)
        return 2
    command = "python bench/bn_policy_rescore.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = [rescore(f, args.max_clients) for f in args.folders]
    text = render(results, command)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "bn_policy_rescore.md").write_text(text)
    (args.results / "bn_policy_rescore.json").write_text(json.dumps({"command": command, "runs": results}, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
