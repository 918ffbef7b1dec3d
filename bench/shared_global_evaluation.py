"""The global test set scored once per distinct deployed model and round, against once per client
(``rafl.federation.runners.evaluate_state``'s ``shared``), on the cross-device config
(``examples/cifar10-cross-device-500.yaml``: the ``cifar10-proxy5k`` supernet, 5,000 global test images).

The map's floor and FedAvg rows deploy one model per device tier to hundreds of clients; scoring each
client's copy on the global set made their evaluation, not their training, the cost of a run (the
90-image cell's floor: 31 min, for three distinct models). Here the same clients of one evaluation are
scored both ways in one process, back to back: every client with ``shared`` (the engine's way), and the
first ``--baseline-clients`` of them one by one without it (the way before), and the counts must be
equal. Prints the seconds per client of each and their ratio; writes
``bench/results/shared_global_evaluation.md``.

Run: ``python bench/shared_global_evaluation.py --data-root R [--clients 100]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

from rafl.federation.engine import Engine
from rafl.federation.run_config import load_run_config
from rafl.federation.runners import client_context, evaluate_client
from rafl.stages.prepare import prepare

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "cifar10-cross-device-500.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-root", required=True)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--method", default="uniform", help="a method whose clients deploy shared models (the map's "
                    "uniform+sbn row by default: FedAvg with train.bn_statistics=server)")
    ap.add_argument("--baseline-clients", type=int, default=12)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_run_config(CONFIG, [f"data.root={args.data_root}", f"clients.n={args.clients}",
                                   f"algorithm.name={args.method}", "engine.rounds=1", "engine.workers=1",
                                   "train.bn_statistics=server", *args.set])
    t0 = time.perf_counter()
    prep = prepare(cfg, progress=False)
    fed = prep.federation
    print(f"prepared {len(fed.clients)} clients in {time.perf_counter() - t0:.0f} s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(fed, prep.engine_config, tmp, progress=False)
        try:
            state, _ = engine._start(resume=False)
            ids = list(range(len(fed.clients)))
            t0 = time.perf_counter()
            shared, _ = engine.clients.evaluate(1, ids, state.broadcast)
            t_shared = (time.perf_counter() - t0) / len(ids)
            base_ids = ids[:args.baseline_clients]
            t0 = time.perf_counter()
            alone = {cid: evaluate_client(fed, engine.store, client_context(fed, engine.clients.seed, cid, 1),
                                          state.broadcast) for cid in base_ids}
            t_alone = (time.perf_counter() - t0) / len(base_ids)
        finally:
            engine.clients.close()
    same = all(alone[c] == shared[c] for c in base_ids)
    models = len({fed.clients[c].model_key for c in ids})
    command = "python bench/shared_global_evaluation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"# The global test set scored once per deployed model\n\nCommand: `{command}` (1 torch thread; "
            f"`{CONFIG.relative_to(ROOT)}`, method `{args.method}`, {len(ids)} clients over {models} deployed "
            f"models, {len(fed.global_test.dataset)} global test images).\n\n"
            "| evaluation | clients timed | s per client | ratio |\n|---|---|---|---|\n"
            f"| every client scored on the global set (before) | {len(base_ids)} | {t_alone:.2f} | 1.00 |\n"
            f"| once per distinct deployed model (`shared`) | {len(ids)} | {t_shared:.2f} | "
            f"{t_alone / t_shared:.1f}x faster |\n\n"
            f"Counts equal for the {len(base_ids)} clients scored both ways: {same}.\n")
    print(text)
    if not same:
        print("error: the shared evaluation's counts differ from scoring each client alone", file=sys.stderr)
        return 1
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "shared_global_evaluation.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
