"""The new-clients protocol: held-out clients never train and are scored at the end on their tier's
final model(s), as deployed and after one local fine-tune (rafl.federation.new_clients)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.config import RunConfig
from rafl.federation.algorithms.base import ClientInfo
from rafl.federation.new_clients import donors, held_out_clients


def test_held_out_clients_are_spread_over_the_tiers_and_fixed_by_the_seed():
    tiers = ["pi4", "jetson-nano", "phone"] * 10                 # 30 clients, 10 per tier
    held = held_out_clients(tiers, 6, seed=0)
    assert len(held) == 6 and held == sorted(held)
    assert sorted(tiers[c] for c in held) == ["jetson-nano"] * 2 + ["phone"] * 2 + ["pi4"] * 2
    assert held_out_clients(tiers, 6, seed=0) == held            # deterministic
    assert held_out_clients(tiers, 6, seed=1) != held            # another run seed, another draw
    assert held_out_clients(tiers, 0, seed=0) == []
    with pytest.raises(ValueError, match="0..29 of 30"):
        held_out_clients(tiers, 30, seed=0)


def test_a_new_client_of_a_per_client_method_deploys_its_tiers_largest_trained_client():
    infos = [ClientInfo(client_id=i, profile=p, arch=None, model_key=p, n_samples=n)
             for i, (p, n) in enumerate([("a", 10), ("b", 30), ("a", 40), ("a", 40), ("b", 5)])]
    assert donors(infos, trained={0, 1, 2, 3, 4}) == {"a": 2, "b": 1}   # most samples, ties to the lowest id
    assert donors(infos, trained={0, 4}) == {"a": 0, "b": 4}            # only clients that trained
    assert donors(infos, trained=set()) == {}


@pytest.mark.parametrize("fraction", [-0.1, 0.6])
def test_held_out_fraction_outside_its_range_is_refused(fraction):
    with pytest.raises(ValueError, match=r"held_out_fraction"):
        RunConfig.model_validate({"clients": {"n": 10, "held_out_fraction": fraction}})


def test_held_out_fraction_that_holds_out_nobody_is_one_line_exit_2_before_torch(tmp_path):
    res = CliRunner().invoke(cli, ["federate", "--no-progress", "--out", str(tmp_path / "o"),
                                   "--set", "clients.n=3", "--set", "clients.held_out_fraction=0.1"])
    assert res.exit_code == 2, res.output
    assert "clients.held_out_fraction 0.1 of clients.n=3 holds out 0 client(s); allowed: 0 (off) or a fraction in " \
           "(0, 0.5]" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()


def test_held_out_clients_never_train_and_are_scored_as_deployed_and_fine_tuned(tmp_path, tiny_supernet):
    path, _ = tiny_supernet
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, [
        "compare", "--no-progress", "--models", "nas", "--algorithms", "uniform,standalone", "--out", str(out),
        "--set", f"supernet.path={path}", "--set", "data.limit_per_class=12", "--set", "clients.n=6",
        "--set", "clients.profiles=[pi4, phone]", "--set", "clients.held_out_fraction=0.34",
        "--set", "algorithm.local_epochs=1", "--set", "engine.rounds=1", "--set", "partition.min_samples=6",
        "--set", "search.method=largest-feasible", "--set", "search.samples=20"])
    assert res.exit_code == 0, res.output
    rows = {r["algorithm"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    for name in ("uniform", "standalone"):
        held = json.loads((out / name / "new_clients.json").read_text())["new_clients"]
        assert held["held_out"] == held_out_clients(["pi4", "phone"] * 3, 2, seed=0)   # round(6 x 0.34) = 2
        table = json.loads((out / name / "clients.json").read_text())["clients"]
        assert len(table) == 4                                   # the engine's population: the other 4
        assert not {r["partition_client"] for r in table} & set(held["held_out"])
        trained = {int(f.name.split(".")[0]) for f in (out / name / "clients").glob("*.st")}
        assert trained <= set(range(4))                          # no state of a held-out client, ever
        assert {c["profile"] for c in held["clients"].values()} == {"pi4", "phone"}
        for c in held["clients"].values():
            assert 0 <= c["model.acc"] <= 1 and 0 <= c["model.acc_ft"] <= 1
        assert rows[name]["new.acc_mean"] == pytest.approx(held["model.acc_mean"])
        assert rows[name]["new-ft.acc_mean"] == pytest.approx(held["model.acc_ft_mean"])
    uniform = json.loads((out / "uniform" / "new_clients.json").read_text())["new_clients"]
    assert {c["donor"] for c in uniform["clients"].values()} == {None}       # the global model, no peer's
    standalone = json.loads((out / "standalone" / "new_clients.json").read_text())["new_clients"]
    assert all(c["donor"] in range(4) for c in standalone["clients"].values())  # a trained client of its tier
    assert rows["uniform-ft"]["new.acc_mean"] == rows["uniform"]["new-ft.acc_mean"]
    assert "new clients acc" in (out / "compare.md").read_text()
