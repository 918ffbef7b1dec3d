"""The centralized ceiling: each tier's subnet trained by the server on the pooled client training data,
as many image-steps per round as the federation's clients take together."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from rafl.cli import cli
from rafl.federation.algorithms import get_algorithm
from rafl.federation.algorithms.base import ClientInfo, ServerContext
from rafl.federation.payload import Payload


def _server(models):
    infos = [ClientInfo(client_id=i, profile=p, arch=None, model_key=p, n_samples=6) for i, p in enumerate(["a", "b", "a"])]

    def make_model(arch=None, client_id=None):
        torch.manual_seed(0)
        return models[infos[client_id].model_key]()

    return ServerContext(clients=infos, make_model=make_model, public_images=torch.zeros(4, 3, 4, 4), n_classes=3,
                         seed=7, round=1)


def _net(width):
    return lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, width), torch.nn.BatchNorm1d(width),
                                       torch.nn.Linear(width, 3))


def test_the_server_trains_every_tier_on_every_upload_and_each_client_downloads_its_own():
    algo = get_algorithm("centralized")(local_epochs=2, batch_size=4, lr=0.1)
    server = _server({"a": _net(5), "b": _net(7)})
    state, down = algo.init_server(server)
    assert state["shape"] == [3, 4, 4]
    assert algo.upload_spec(state, server.clients[0]) == {"images": (6, 3, 4, 4), "labels": (6,)}
    mine = algo.client_broadcast(down, server.clients[1])
    assert set(mine.tensors) == set(_net(7)().state_dict())       # tier b's model only
    g = torch.Generator().manual_seed(0)
    ups = [Payload({"images": torch.randn(6, 3, 4, 4, generator=g), "labels": torch.randint(0, 3, (6,), generator=g)},
                   {"n_samples": 6, "client_id": c}) for c in (0, 1)]
    new, nxt = algo.server_aggregate(ups, state, server)
    for key in ("a", "b"):                                          # both tiers learnt from both clients' images
        assert any(not torch.equal(new["models"][key][k], state["models"][key][k]) for k in state["models"][key])
    again, _ = algo.server_aggregate(ups, state, server)           # the round's server seed: deterministic
    assert all(torch.equal(again["models"]["a"][k], new["models"]["a"][k]) for k in new["models"]["a"])
    assert json.loads(nxt.meta["keys"]) == ["a", "b"] and nxt.meta["round"] == 2


def test_centralized_is_a_row_of_rafl_compare(tmp_path, tiny_supernet):
    path, _ = tiny_supernet
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, [
        "compare", "--no-progress", "--models", "nas", "--algorithms", "centralized,standalone", "--out", str(out),
        "--set", f"supernet.path={path}", "--set", "data.limit_per_class=12", "--set", "clients.n=4",
        "--set", "clients.profiles=[pi4, phone]", "--set", "algorithm.local_epochs=1", "--set", "engine.rounds=2",
        "--set", "partition.min_samples=6", "--set", "search.method=largest-feasible", "--set", "search.samples=20"])
    assert res.exit_code == 0, res.output
    rows = {r["algorithm"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    row = rows["centralized"]
    assert 0 <= row["model.acc_mean"] <= 1 and row["bn_statistics"] == "pooled"
    assert row["mb_up"] > 0                                          # its uploads are the clients' images
