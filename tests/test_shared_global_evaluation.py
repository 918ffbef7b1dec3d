"""The global test set is scored once per distinct deployed model and round (``evaluate_state``'s
``shared``): the counts every client gets are the ones scoring it alone gives, and clients that deploy
the same model (FedAvg, the floor, any method under server BN statistics) cost one scoring."""

from __future__ import annotations

import pytest
import torch

from rafl.config import RunConfig
from rafl.federation.engine import Engine
from rafl.federation.runners import client_context, deployed_fingerprint, evaluate_client
from rafl.stages.prepare import prepare
from rafl.stages.runs import run_engine


def _config(method: str, train: dict | None = None) -> RunConfig:
    return RunConfig.model_validate({
        "seed": 0, "data": {"dataset": "digits", "limit_per_class": 30},
        "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_samples": 10, "public_fraction": 0.3,
                      "global_test_per_class": 3},
        "clients": {"n": 4, "models": "cnn4-small", "feature_dim": 16},
        "algorithm": {"name": method, "local_epochs": 1},
        "engine": {"rounds": 1, "clients_per_round": 2, "workers": 1, "eval_clients": "all"},
        "train": {"batch_size": 8, "threads": 1, **(train or {})},
    })


@pytest.mark.parametrize("method,train,scorings", [
    ("fedavg", {"bn_statistics": "server"}, 1),   # one global model, the pool's statistics: one scoring
    ("fedavg", {}, 1),                              # FedAvg's own rule (averaged statistics)
    ("fedavg", {"bn_statistics": "client"}, 4),     # each client's own statistics: each scored
    ("centralized", {}, 1),                         # one model per tier, cnn4-small: one tier, one scoring
    ("standalone", {}, 4),                          # cnn4-small: every client its own initial draw, so no two alike
    ("fedproto", {}, 4),                            # a method that reads more than the state: never shared
])
def test_each_client_gets_the_counts_of_scoring_it_alone(tmp_path, method, train, scorings):
    cfg = _config(method, train)
    prep = prepare(cfg, progress=False)
    fed = prep.federation
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_engine(fed, prep.engine_config, run_dir, progress=False)
    engine = Engine(fed, prep.engine_config, run_dir, progress=False)
    try:
        state, start = engine._start(resume=True)
        rnd, ids = start - 1, list(range(len(fed.clients)))
        calls = []
        evaluate = fed.algorithm.evaluate

        def counting(s, ctx):
            calls.append(ctx.test_loader is fed.global_test)
            return evaluate(s, ctx)

        fed.algorithm.evaluate = counting
        shared_counts, lost = engine.clients.evaluate(rnd, ids, state.broadcast)
        assert not lost and sum(calls) == scorings
        alone = {cid: evaluate_client(fed, engine.store, client_context(fed, engine.clients.seed, cid, rnd), state.broadcast)
                 for cid in ids}
    finally:
        engine.clients.close()
    assert shared_counts == alone
    assert all(r["model@global.total"] == len(fed.global_test.dataset) for r in alone.values())


def test_no_fingerprint_for_a_state_it_cannot_read():
    cfg = _config("fedavg", {"bn_statistics": "server"})
    prep = prepare(cfg, progress=False)
    fed = prep.federation
    ctx = client_context(fed, 0, 0, 1)
    assert deployed_fingerprint(fed, {"model": {"w": object()}}, ctx) is None
    a = deployed_fingerprint(fed, {"model": {"w": [1, 2.0, "x", None]}}, ctx)
    assert a is not None and a == deployed_fingerprint(fed, {"model": {"w": [1, 2.0, "x", None]}}, ctx)
    assert a != deployed_fingerprint(fed, {"model": {"w": [1, 2.0, "y", None]}}, ctx)
    # tensors of every rank and dtype a state holds (BN's 0-dim num_batches_tracked among them)
    tensors = {"n": torch.tensor(3), "w": torch.ones(2, 3), "b": torch.zeros(0), "m": torch.tensor([True, False])}
    b = deployed_fingerprint(fed, {"model": tensors}, ctx)
    assert b is not None and b == deployed_fingerprint(fed, {"model": {k: v.clone() for k, v in tensors.items()}}, ctx)
    assert b != deployed_fingerprint(fed, {"model": {**tensors, "n": torch.tensor(4)}}, ctx)
    assert b != deployed_fingerprint(fed, {"model": {**tensors, "w": torch.ones(3, 2)}}, ctx)
