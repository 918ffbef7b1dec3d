"""``examples/*.yaml``: every shipped run config loads as it is, and runs one tiny round (shrunk with
``--set``) on real data where that is cheap: CIFAR-10 from the shared tarball, FEMNIST from LEAF shards."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rafl.cli import cli
from rafl.federation.run_config import load_run_config

from conftest import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_the_seven_examples_are_shipped():
    assert [p.name for p in EXAMPLES] == ["cifar10-cross-device-100.yaml", "cifar10-cross-device-500.yaml",
                                          "cifar10-devices.yaml", "cifar10-htfe.yaml", "cifar10-nas.yaml",
                                          "femnist-natural.yaml", "flower-deployment.yaml"]


@pytest.mark.parametrize("n", [500, 100])
@pytest.mark.parametrize("alpha", [0.5, 0.1])
def test_cross_device_examples_carve_a_5000_image_pool_and_give_the_other_train_images_to_clients(n, alpha):
    """The cross-device configs (issue 56) on CIFAR-10's shape (50,000 train + 10,000 test labels): the
    server's pool is 5,000 train images, the clients hold the other 45,000 train images (and the test
    images outside the global set), pool, clients and global test set pairwise disjoint; about 90 (500
    clients) or 450 (100 clients) train images per client; the pool is the one the shipped small-proxy
    supernet cifar10-proxy5k trained on (its preset's)."""
    import numpy as np
    import yaml

    from rafl.data import make_partition
    from rafl.federation.checks import check_disjoint

    path = REPO / "examples" / f"cifar10-cross-device-{n}.yaml"
    cfg = load_run_config(path, [f"partition.alpha={alpha}"])
    assert cfg.supernet.path == "cifar10-proxy5k" and cfg.engine.clients_per_round == 0.1
    preset = yaml.safe_load((REPO / "rafl" / "supernet" / "presets" / "cifar10-proxy5k.yaml").read_text())
    assert (cfg.partition.public_fraction, cfg.partition.public_seed) == (preset["public_fraction"],
                                                                           preset["public_seed"])
    labels = np.concatenate([np.repeat(np.arange(10), 5000), np.repeat(np.arange(10), 1000)])
    origin = np.array(["train"] * 50000 + ["test"] * 10000)
    p = cfg.partition
    part = make_partition(labels, p.scheme, cfg.clients.n, cfg.seed, alpha=p.alpha, min_samples=p.min_samples,
                          public_fraction=p.public_fraction, public_seed=p.public_seed, split=tuple(p.split),
                          origin=origin, global_test_per_class=p.global_test_per_class)
    check_disjoint(part)                                     # pool, clients' splits, global test: disjoint
    clients = np.concatenate([c.all() for c in part.clients])
    assert len(part.public) == 5000 and (origin[part.public] == "train").all()
    assert (origin[clients] == "train").sum() == 45000        # every other train image is a client's
    assert not np.isin(clients, part.public).any() and not np.isin(clients, part.global_test).any()
    train = sum(len(c.train) for c in part.clients)
    assert abs(train / n - 45000 / n) <= 0.01 * 45000 / n     # ~90 / ~450 train images per client
    assert p.scheme == "balanced-dirichlet"                  # equal clients: 50,000 / n images each
    assert {c.n_samples for c in part.clients} == {50000 // n} and p.min_samples <= 50000 // n


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_an_example_loads_and_shows_as_a_config(path):
    cfg = load_run_config(path)  # every key known, every value allowed, the method's hyperparameters checked
    assert cfg.algorithm.name in {"rafl", "fedtgp", "fedgh"}
    res = CliRunner().invoke(cli, ["federate", "--show-config", "--config", str(path)])
    assert res.exit_code == 0, res.output
    assert f"name: {cfg.algorithm.name}" in res.output and "rounds:" in res.output


def test_cifar10_nas_example_points_at_the_cifar10_preset_pool():
    import yaml

    cfg = load_run_config(REPO / "examples" / "cifar10-nas.yaml")
    preset = yaml.safe_load((REPO / "rafl" / "supernet" / "presets" / "cifar10.yaml").read_text())
    assert (cfg.partition.public_fraction, cfg.partition.public_seed) == (preset["public_fraction"],
                                                                           preset["public_seed"])
    assert cfg.supernet.path == "cifar10"  # the shipped supernet: the example runs without training one


def test_the_headline_example_is_a_comparison_on_the_shipped_cifar10_supernet():
    import yaml

    from rafl.stages.compare import load_compare_config

    path = REPO / "examples" / "cifar10-devices.yaml"
    methods = ["standalone", "uniform", "heterofl", "fedrolex", "rafl", "fedgh", "fedtgp", "fedproto"]
    cfg, hparams = load_compare_config(path, [], methods)
    assert list(hparams) == methods and all(hp["local_epochs"] == 1 for hp in hparams.values())
    assert cfg.supernet.path == "cifar10" and cfg.clients.models == "nas" and cfg.clients.budgets == {}
    assert cfg.clients.profiles == ["pi4", "jetson-nano", "phone"] and cfg.clients.archs == {}
    preset = yaml.safe_load((REPO / "rafl" / "supernet" / "presets" / "cifar10.yaml").read_text())
    assert (cfg.partition.public_fraction, cfg.partition.public_seed) == (preset["public_fraction"],
                                                                           preset["public_seed"])
    # the search as rafl search runs it (its measurements shared): the whole server-val split, 500 subnets
    assert (cfg.search.predictor_samples, cfg.search.val_samples, cfg.search.population,
            cfg.search.generations) == (500, 5000, 100, 500)


def _federate(args, out):
    res = CliRunner().invoke(cli, ["federate", "--no-progress", *args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    return run_dir, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def cifar_cache(tmp_path_factory):
    """One rafl cache for this module's CIFAR-10 runs: the tarball is decoded once."""
    return tmp_path_factory.mktemp("cifar-cache")


@pytest.mark.slow
def test_cifar10_htfe_example_runs_a_tiny_round(tmp_path, shared_cifar10_tarball, cifar_cache, monkeypatch):
    monkeypatch.setenv("RAFL_CACHE_DIR", str(cifar_cache))
    run_dir, summary = _federate(["--config", str(REPO / "examples" / "cifar10-htfe.yaml"),
                                  "--set", f"data.root={shared_cifar10_tarball}", "--set", "data.limit_per_class=8",
                                  "--set", "clients.n=4", "--set", "engine.rounds=1",
                                  "--set", "algorithm.fedtgp.server_epochs=2"], tmp_path / "runs")
    assert summary["rounds"] == 1 and summary["algorithm"] == "fedtgp"
    assert 0.0 <= summary["final"]["model.acc_mean_over_clients"] <= 1.0
    models = [c["model"] for c in json.loads((run_dir / "clients.json").read_text())["clients"]]
    assert len(set(models)) == 4  # four different members of htfe-tiny


@pytest.mark.slow
def test_cifar10_nas_example_runs_a_tiny_round(tmp_path, shared_cifar10_tarball, cifar_cache, monkeypatch):
    import torch

    from rafl.supernet import SearchSpace, build_supernet, save_supernet

    monkeypatch.setenv("RAFL_CACHE_DIR", str(cifar_cache))
    torch.manual_seed(0)
    space = SearchSpace(width_mult=0.25, resolutions=(32,), n_classes=10)
    supernet_dir = tmp_path / "supernet-c10"
    save_supernet(supernet_dir, build_supernet(space).eval(), metrics={},
                  config={"dataset": "cifar10", "limit_per_class": 8, "public_fraction": 0.5, "public_seed": 0})
    _, summary = _federate(["--config", str(REPO / "examples" / "cifar10-nas.yaml"),
                            "--set", f"data.root={shared_cifar10_tarball}", "--set", "data.limit_per_class=8",
                            "--set", f"supernet.path={supernet_dir}", "--set", "clients.n=3",
                            "--set", "partition.min_samples=4", "--set", "engine.rounds=1",
                            "--set", "search.population=4", "--set", "search.generations=1",
                            "--set", "search.predictor_samples=4", "--set", "search.top_k=1",
                            "--set", "search.val_samples=8"], tmp_path / "runs")
    assert summary["rounds"] == 1 and summary["algorithm"] == "rafl"
    assert {r["profile"] for r in summary["table"]} == {"pi4", "jetson-nano", "phone"}


def test_femnist_natural_example_runs_a_tiny_round(tmp_path):
    from test_data_sources import _write_leaf  # tests/ is on sys.path (rootdir conftest)

    root = tmp_path / "femnist"
    _write_leaf(root / "train", {"f0000_14": 40, "f0001_41": 44, "f0002_07": 48}, seed=0)
    _write_leaf(root / "test", {"f0000_14": 8, "f0001_41": 8, "f0002_07": 8}, seed=1)
    run_dir, summary = _federate(["--config", str(REPO / "examples" / "femnist-natural.yaml"),
                                  "--set", f"data.root={root}", "--set", "clients.n=3",
                                  "--set", "engine.rounds=1", "--set", "engine.clients_per_round=3"],
                                 tmp_path / "runs")
    assert summary["rounds"] == 1 and summary["algorithm"] == "fedgh"
    assert len(summary["table"]) == 3  # one client per writer


def test_flower_example_writes_a_flower_app(tmp_path):
    cfg = load_run_config(REPO / "examples" / "flower-deployment.yaml")
    assert cfg.engine.backend == "flower"
    res = CliRunner().invoke(cli, ["flower-app", "--out", str(tmp_path / "app"), "--config",
                                   str(REPO / "examples" / "flower-deployment.yaml"), "--runs", str(tmp_path / "runs")])
    assert res.exit_code == 0, res.output
    app = (tmp_path / "app" / "pyproject.toml").read_text()
    assert str((REPO / "examples" / "flower-deployment.yaml").resolve()) in app
