"""train.bn_statistics: where the deployed models' BatchNorm statistics come from (client, server,
local = FedBN), one option for every method, decided in rafl.federation.bn_statistics."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.federation.algorithms import get_algorithm
from rafl.federation.bn_statistics import (
    bn_keys,
    check_run,
    deployment,
    effective,
    own_bn,
    server_batches,
    with_own_bn,
)
from rafl.federation.training import evaluate_accuracy, recalibrate_local_bn
from rafl.supernet.model import recalibrate_bn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3))


def _batches(shift: float, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(int(shift * 10) + 1)
    return [(torch.randn(8, 3, 6, 6, generator=g) + shift, torch.zeros(8, dtype=torch.long)) for _ in range(n)]


def test_the_methods_own_rules_are_named_and_kept():
    assert effective(get_algorithm("uniform")(), None) == "averaged"
    assert effective(get_algorithm("fedavg")(), None) == "averaged"
    assert effective(get_algorithm("heterofl")(), None) == "averaged"
    assert effective(get_algorithm("heterofl")(static_bn=True, sbn_statistics="server"), None) == "server"
    assert effective(get_algorithm("fedrolex")(static_bn=True), None) == "client"
    for name in ("standalone", "fedgh", "fedtgp", "fedproto", "rafl"):
        assert effective(get_algorithm(name)(), None) == "client", name
    assert effective(get_algorithm("pretrained")(), None) == "server"
    assert effective(get_algorithm("standalone")(), "server") == "server"


@pytest.mark.parametrize("policy", ["client", "server"])
def test_a_deployed_model_is_scored_with_the_policys_statistics(policy):
    """Within the deployment context every scoring helper re-estimates the model's BN statistics once,
    on the client's training split (client) or the server's calibration images (server); outside it
    (or under the method's own rule) the model is scored as it is."""
    train = _batches(2.0)
    pool = torch.randn(40, 3, 6, 6, generator=torch.Generator().manual_seed(5)) - 1.0
    algo = get_algorithm("uniform")()
    model = _net().eval()
    before = model[1].running_mean.clone()
    evaluate_accuracy(model, train)                                    # no context: unchanged
    assert torch.equal(model[1].running_mean, before)
    with deployment(None, algo, train, pool, "cpu"):                   # the method's own rule: unchanged
        evaluate_accuracy(model, train)
    assert torch.equal(model[1].running_mean, before)
    with deployment(policy, algo, train, pool, "cpu"):
        evaluate_accuracy(model, train)
        got = model[1].running_mean.clone()
        evaluate_accuracy(model, train)                                # once per model and context
        assert torch.equal(model[1].running_mean, got)
    ref = _net()
    if policy == "client":
        recalibrate_local_bn(ref, train)
    else:
        recalibrate_bn(ref, server_batches(pool), n_batches=None)
    assert torch.allclose(got, ref[1].running_mean)
    assert not torch.allclose(got, before)


def test_fedbn_keeps_the_clients_own_bn_layers():
    model = _net()
    keys = bn_keys(model)
    assert keys == ["1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    own = own_bn(model)
    server = {k: torch.full_like(v, 7.0) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    merged = with_own_bn(server, own)
    assert all(torch.equal(merged[k], own[k]) for k in keys)                   # the client's BN layers
    assert torch.equal(merged["0.weight"], server["0.weight"])                 # the federation's other weights
    assert with_own_bn(server, None) == server and with_own_bn(server, {}) == server   # never trained: the server's


def test_policies_a_run_cannot_follow_are_refused_naming_the_field():
    with pytest.raises(UserInputError, match=r"train.bn_statistics: is server.*has none; allowed: client or local"):
        check_run(get_algorithm("uniform")(), "server", None)
    with pytest.raises(UserInputError, match=r"train.bn_statistics: is local .*feddf does not implement"):
        check_run(get_algorithm("feddf")(), "local", torch.zeros(4, 3, 6, 6))
    with pytest.raises(UserInputError, match=r"train.bn_statistics: is local .*heterofl"):
        check_run(get_algorithm("heterofl")(static_bn=True), "local", None)
    with pytest.raises(UserInputError, match=r"train.bn_statistics: is 'global', allowed: one of client, server, local"):
        check_run(get_algorithm("uniform")(), "global", None)
    check_run(get_algorithm("pretrained")(), "server", None)   # its own rule: nothing to check
    check_run(get_algorithm("standalone")(), "local", None)    # a private model: its BN layers are its own


def test_a_bad_policy_in_the_config_is_one_line_exit_2(tmp_path):
    res = CliRunner().invoke(cli, ["federate", "--no-progress", "--out", str(tmp_path / "o"),
                                   "--set", "train.bn_statistics=pool"])
    assert res.exit_code == 2 and "train.bn_statistics" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def _compare(tmp_path, supernet, name: str, algorithms: str, *sets: str) -> dict:
    out = tmp_path / name
    args = ["compare", "--no-progress", "--models", "nas", "--algorithms", algorithms, "--out", str(out),
            "--no-finetune", "--set", f"supernet.path={supernet}", "--set", "data.limit_per_class=12",
            "--set", "clients.n=4", "--set", "clients.profiles=[pi4, phone]", "--set", "algorithm.local_epochs=1",
            "--set", "engine.rounds=2", "--set", "partition.min_samples=6", "--set", "search.method=largest-feasible",
            "--set", "search.samples=20"]
    for s in sets:
        args += ["--set", s]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    return {r["algorithm"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}


def test_every_row_says_its_policy_and_the_policy_changes_the_deployed_statistics(tmp_path, tiny_supernet):
    """Tiny digits runs: the method's own rule by default (bit for bit as before), server statistics for
    every method with train.bn_statistics=server, FedBN's client-kept BN layers with local."""
    path, _ = tiny_supernet
    own = _compare(tmp_path, path, "own", "uniform,standalone")
    assert own["uniform"]["bn_statistics"] == "averaged" and own["standalone"]["bn_statistics"] == "client"
    assert "BN statistics" in (tmp_path / "own" / "compare.md").read_text()
    server = _compare(tmp_path, path, "server", "uniform,standalone", "train.bn_statistics=server")
    assert {r["bn_statistics"] for r in server.values()} == {"server"}
    summary = json.loads((tmp_path / "server" / "uniform" / "summary.json").read_text())
    assert summary["bn_statistics"] == "server"
    for m in ("uniform", "standalone"):   # the same weights, other statistics: other scores
        assert server[m]["model.acc_mean"] != own[m]["model.acc_mean"] or \
            server[m]["model@global.acc_mean" if "model@global.acc_mean" in own[m] else "model.acc_std"] != \
            own[m]["model@global.acc_mean" if "model@global.acc_mean" in own[m] else "model.acc_std"], m
    local = _compare(tmp_path, path, "local", "uniform", "train.bn_statistics=local")
    assert local["uniform"]["bn_statistics"] == "local"
    from rafl.federation.store import load_state

    states = [load_state(f) for f in (tmp_path / "local" / "uniform" / "clients").glob("*.st")]
    assert states and all(set(s) == {"bn"} and s["bn"] for s in states)   # each trained client keeps its BN layers
