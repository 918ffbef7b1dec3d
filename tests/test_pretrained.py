"""The shipped CIFAR-10 supernet: its recipe (--preset cifar10), loading by name offline, its
accuracy on real CIFAR-10 test images, and refusal of altered or missing weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from rafl.cli import cli
from rafl.data import load_dataset
from rafl.errors import UserInputError
from rafl.federation.run_config import load_run_config
from rafl.supernet import load_supernet
from rafl.supernet import pretrained as pt
from rafl.supernet.presets import preset_path
from rafl.supernet.train import TrainConfig, evaluate_subnet


def test_unknown_preset_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["supernet", "train", "--preset", "imagenet", "--out", str(out)])
    assert res.exit_code == 2
    assert res.output.strip() == "error: --preset: is 'imagenet', allowed: one of cifar10, cifar10-proxy5k, cifar10-short"
    assert not out.exists()
    res = CliRunner().invoke(cli, ["supernet", "train", "--preset", "cifar10", "--out", str(out)],
                             env={"RAFL_DATA_ROOT": ""})
    assert res.exit_code == 2 and "needs a data root" in res.output and not out.exists()


@pytest.mark.parametrize("name", ["cifar10", "cifar10-proxy5k"])
def test_each_shipped_supernet_is_its_presets_recipe(tmp_path, name):
    from rafl.io import load_yaml

    recipe = load_yaml(preset_path(name).read_text(), preset_path(name))
    cfg = TrainConfig.from_options(**recipe, data_root=str(tmp_path))
    shipped = TrainConfig.as_recorded_now(json.loads((pt.PRETRAINED_DIR / name / "config.json").read_text()))
    mine = json.loads(cfg.model_dump_json())
    assert {k: v for k, v in mine.items() if k != "data_root"} == {k: v for k, v in shipped.items() if k != "data_root"}
    assert shipped["dataset"] == "cifar10" and shipped["test_samples"] == 10000
    # the server's pool: 25,000 train images for cifar10, 5,000 (its server-val included) for the small proxy
    assert shipped["public_fraction"] * 50_000 == {"cifar10": 25_000, "cifar10-proxy5k": 5_000}[name]
    assert 0 < shipped["public_fraction"] < 1 and shipped["hflip"] is True and shipped["crop_padding"] == 4


@pytest.mark.parametrize("name", ["cifar10", "cifar10-proxy5k"])
def test_each_shipped_supernet_loads_by_name_and_classifies_real_test_images(shared_cifar10_tarball, name):
    """Top-1 on 1,000 CIFAR-10 test images (100 per class), BN recalibrated on train images, as
    `rafl supernet info` reports for the whole test split: fails if the weights are wrong."""
    net = load_supernet(name)
    space = net.space
    meta = json.loads((pt.PRETRAINED_DIR / name / "supernet.json").read_text())
    ds = load_dataset("cifar10", shared_cifar10_tarball, limit_per_class=100)
    test = np.flatnonzero(ds.origin == "test")
    train = np.flatnonzero(ds.origin == "train")
    assert len(test) == 1000
    calib = [ds.images[torch.as_tensor(train[i:i + 128])] for i in range(0, len(train), 128)][:8]
    x, y = ds.images[torch.as_tensor(test)], ds.labels[torch.as_tensor(test)]
    got = {w: evaluate_subnet(net, a, x, y, calib) for w, a in (("smallest", space.smallest()),
                                                             ("largest", space.largest()))}
    reported = meta["metrics"]["test"]  # on all 10,000 test images
    for which in ("smallest", "largest"):  # binomial SE on 1,000 images is ~1.5 points
        assert got[which] >= reported[which] - 0.06, (which, got, reported)
    assert got["largest"] > got["smallest"]


def test_supernet_name_in_a_run_config_stays_a_name():
    cfg = load_run_config(None, ["supernet=cifar10"])
    assert cfg.supernet.path == "cifar10"
    cfg = load_run_config(None, ["supernet.path=cifar10"])
    assert cfg.supernet.path == "cifar10"


def test_altered_or_missing_shipped_weights_are_refused(tmp_path, monkeypatch):
    copy = tmp_path / "pretrained"
    shutil.copytree(pt.PRETRAINED_DIR, copy)
    monkeypatch.setattr(pt, "PRETRAINED_DIR", copy)
    weights = copy / "cifar10" / "supernet.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    meta = json.loads((copy / "cifar10" / "supernet.json").read_text())
    import hashlib

    meta["weights_sha256"] = hashlib.sha256(bytes(data)).hexdigest()  # even a matching supernet.json
    (copy / "cifar10" / "supernet.json").write_text(json.dumps(meta))
    with pytest.raises(UserInputError, match="altered or truncated"):
        load_supernet("cifar10")
    res = CliRunner().invoke(cli, ["search", "--device-profile", "pi4", "--supernet", "cifar10",
                                   "--out", str(tmp_path / "s")])
    assert res.exit_code == 2 and "altered or truncated" in res.output and not (tmp_path / "s").exists()
    weights.unlink()
    res = CliRunner().invoke(cli, ["supernet", "info", "cifar10"])
    assert res.exit_code == 2 and "missing from the installed package" in res.output
