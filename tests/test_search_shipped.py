"""Measurements shipped beside a supernet (``measurements.json`` + ``calibration.safetensors``):
made by :func:`write_measurements`, searched without data, checked; and ``rafl search``
stopped by Ctrl-C / SIGTERM while its worker processes measure.

A tiny random supernet on digits (width 0.35, the pipeline test's), 8 measured subnets, a
population of 6 for 2 generations: seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rafl.stages.search as stage
import rafl.supernet.pretrained as pt
from rafl.errors import UserInputError
from rafl.search.estimators import sample_across_space
from rafl.search.evolution import SearchConfig
from rafl.stages.search import run_search, write_measurements
from rafl.supernet import build_supernet, save_supernet
from rafl.supernet.arch import SearchSpace

SPACE = SearchSpace(width_mult=0.35)
DATA_CFG = {"dataset": "digits", "image_size": 32, "public_fraction": 0.3, "public_seed": 0, "val_fraction": 0.1}
TINY = dict(population=6, generations=2, top_k=2, calib_batches=1, batch_size=64, seed=0, progress=False)


@pytest.fixture(scope="module")
def measured_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("supernet")
    save_supernet(d, build_supernet(SPACE), DATA_CFG, {})
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: before conftest's per-test cache dir
        mp.setenv("RAFL_CACHE_DIR", str(tmp_path_factory.mktemp("rafl-cache")))
        write_measurements(d, samples=8, seed=0, workers=1, profiles=["pi4", "mcu"], config=SearchConfig(**TINY),
                           say=lambda line: None, progress=False)
    return d


@pytest.mark.slow
def test_write_measurements_records_the_sample_halves_and_the_calibration(measured_dir):
    doc = json.loads((measured_dir / pt.MEASUREMENTS_NAME).read_text())
    keys = [a.to_string() for a in sample_across_space(SPACE, 8, 0)]
    assert doc["predictor_samples"]["archs"] == keys and doc["predictor_samples"]["n"] == 8
    assert set(keys) <= set(doc["accuracy"]) and set(doc["finalists"]) == {"pi4"}  # mcu: no subnet fits
    assert set(doc["finalists"]["pi4"]) <= set(doc["accuracy"])
    n_a, n_b = doc["noise_ceiling"]["half_sizes"]
    assert n_a + n_b == doc["data"]["n_val"]
    for k, acc in doc["accuracy"].items():  # the halves are the same predictions, split in two
        a, b = doc["halves"][k]
        assert acc == pytest.approx((a * n_a + b * n_b) / (n_a + n_b), abs=1e-12)
    assert doc["supernet_sha256"] == hashlib.sha256((measured_dir / "supernet.safetensors").read_bytes()).hexdigest()
    assert doc["measurement"] == {"batch_size": 64, "calib_batches": 1} and doc["calibration"]["n"] == 64


@pytest.mark.slow
def test_search_on_the_measurements_reads_no_data_and_equals_the_measured_search(measured_dir, tmp_path,
                                                                                 monkeypatch):
    cfg = SearchConfig(**TINY)
    real = stage.load_dataset

    def no_data(*args, **kwargs):
        raise UserInputError("no dataset here", field="data_root")

    monkeypatch.setattr(stage, "load_dataset", no_data)
    lines: list[str] = []
    res = run_search(["pi4"], tmp_path / "shipped", cfg, supernet_dir=measured_dir, say=lines.append)
    assert res["pi4"].accuracy_source == "measured" and res["pi4"].n_measured == 0
    assert res["pi4"].predictor_fit["n_holdout"] == 8  # the predictor trained on every shipped subnet
    assert lines and "measured on this supernet's server-val split" in lines[0]
    doc = json.loads((measured_dir / pt.MEASUREMENTS_NAME).read_text())
    assert res["pi4"].accuracy == doc["accuracy"][res["pi4"].arch.to_string()]
    # the same search measuring on the data: the same pick, accuracy and BN-recalibrated weights
    monkeypatch.setattr(stage, "load_dataset", real)
    again = run_search(["pi4"], tmp_path / "measured", cfg.model_copy(update={"predictor_samples": 8}),
                       supernet_dir=measured_dir, remeasure=True)
    assert again["pi4"].arch == res["pi4"].arch and again["pi4"].accuracy == res["pi4"].accuracy
    a = load_file(tmp_path / "shipped" / "pi4" / "subnet.safetensors")
    b = load_file(tmp_path / "measured" / "pi4" / "subnet.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_finalist_not_measured_keeps_its_prediction_without_data(measured_dir, tmp_path, monkeypatch):
    def no_data(*args, **kwargs):
        raise UserInputError("no dataset here", field="data_root")

    monkeypatch.setattr(stage, "load_dataset", no_data)
    res = run_search(["jetson-nano"], tmp_path / "out", SearchConfig(**TINY), supernet_dir=measured_dir)
    r = res["jetson-nano"]
    doc = json.loads((measured_dir / pt.MEASUREMENTS_NAME).read_text())
    if r.arch.to_string() in doc["accuracy"]:
        assert r.accuracy_source == "measured" and r.accuracy == doc["accuracy"][r.arch.to_string()]
    else:
        assert r.accuracy_source == "predicted" and r.accuracy == r.predicted_accuracy
    assert all(t["measured"] == (t["arch"] in doc["accuracy"]) for t in r.top_k)
    result = json.loads((tmp_path / "out" / "jetson-nano" / "result.json").read_text())
    assert result["accuracy_source"] == r.accuracy_source
    # more predictor samples than measured: they have to be measured, and there is no data
    with pytest.raises(UserInputError, match="9 subnets|1 subnets"):
        run_search(["pi4"], tmp_path / "more", SearchConfig(**TINY, predictor_samples=9), supernet_dir=measured_dir)
    assert not (tmp_path / "more").exists()


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_measurements_of_other_weights_or_altered_files_are_refused(measured_dir, tmp_path, monkeypatch):
    other = _copy(measured_dir, tmp_path / "other")
    torch.manual_seed(1)
    save_supernet(other, build_supernet(SPACE), DATA_CFG, {})  # new weights, the old measurements beside them
    with pytest.raises(UserInputError, match="measured on other weights"):
        pt.supernet_measurements(other)
    cal = _copy(measured_dir, tmp_path / "cal")
    (cal / pt.CALIBRATION_NAME).write_bytes((cal / pt.CALIBRATION_NAME).read_bytes()[:-8])
    with pytest.raises(UserInputError, match="not the one measurements.json was made with"):
        pt.supernet_measurements(cal)
    # a shipped supernet: its measurements' SHA-256 is registered in the code
    shipped = tmp_path / "pretrained"
    shipped.mkdir()
    _copy(measured_dir, shipped / "tiny")
    digest = hashlib.sha256((shipped / "tiny" / pt.MEASUREMENTS_NAME).read_bytes()).hexdigest()
    monkeypatch.setattr(pt, "PRETRAINED_DIR", shipped)
    monkeypatch.setattr(pt, "PRETRAINED", {"tiny": "unused"})
    monkeypatch.setattr(pt, "PRETRAINED_MEASUREMENTS", {"tiny": digest})
    assert pt.supernet_measurements(shipped / "tiny")["predictor_samples"]["n"] == 8
    doc = json.loads((shipped / "tiny" / pt.MEASUREMENTS_NAME).read_text())
    first = next(iter(doc["accuracy"]))
    doc["accuracy"][first] = 1.0
    (shipped / "tiny" / pt.MEASUREMENTS_NAME).write_text(json.dumps(doc))
    with pytest.raises(UserInputError, match="have been altered"):
        pt.supernet_measurements(shipped / "tiny")


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_search_while_workers_measure(tmp_path, signum, code):
    torch.manual_seed(0)
    d = tmp_path / "supernet"
    save_supernet(d, build_supernet(SPACE), DATA_CFG, {})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rafl", "search", "--device-profile", "pi4", "--supernet", str(d), "--out", str(out),
         "--predictor-samples", "64", "--workers", "2", "--population", "4", "--generations", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = b""
    try:
        # wait (no sleep) for the first line and a progress update of the workers' bar: >= 1 subnet done
        while not re.search(rb"subnets for the predictor: 64 subnets.*\n.*\| *[1-9]\d*/63 \[", seen, re.S):
            chunk = proc.stderr.read1(4096)
            assert chunk, seen.decode(errors="replace")
            seen += chunk
        proc.send_signal(signum)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (seen + rest).decode(errors="replace")
    assert proc.returncode == code, err
    assert "fewer with --predictor-samples" in err  # the first line says how to make it shorter
    assert "interrupted: rafl search stopped" in err and "Traceback" not in err
    assert not out.exists()  # nothing half-written
    cache = list((Path(os.environ["RAFL_CACHE_DIR"]) / "search-measurements").glob("*.json"))
    assert len(cache) == 1 and len(json.loads(cache[0].read_text())["accuracy"]) >= 2  # what was measured is kept


@pytest.mark.slow
@pytest.mark.parametrize("name,n_val", [("cifar10", 5000), ("cifar10-proxy5k", 1000)])
def test_shipped_measurements_answer_a_search_without_data(tmp_path, monkeypatch, name, n_val):
    """`rafl search --supernet NAME --device-profile pi4` with the default options: no dataset is
    read and nothing is measured; the pick is a shipped measured subnet (a finalist, or one measured
    before) with its shipped accuracy, at least as accurate as every shipped finalist of pi4."""
    from click.testing import CliRunner

    from rafl.cli import cli

    folder = pt.pretrained_path(name)
    doc = pt.supernet_measurements(folder)
    from rafl.supernet import load_supernet

    space = load_supernet(folder).space
    n, seed = doc["predictor_samples"]["n"], doc["predictor_samples"]["seed"]
    assert doc["predictor_samples"]["archs"] == [a.to_string() for a in sample_across_space(space, n, seed)]
    assert all(0.0 <= v <= 1.0 for v in doc["accuracy"].values()) and doc["data"]["n_val"] == n_val

    def no_data(*args, **kwargs):
        raise AssertionError("a dataset was read")

    monkeypatch.setattr(stage, "load_dataset", no_data)
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["search", "--supernet", name, "--device-profile", "pi4", "--out", str(out),
                                   "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    result = json.loads((out / "pi4" / "result.json").read_text())
    assert result["accuracy_source"] == "measured" and result["arch_string"] in doc["accuracy"]
    assert result["accuracy"] == doc["accuracy"][result["arch_string"]]
    assert result["accuracy"] >= max(doc["accuracy"][k] for k in doc["finalists"]["pi4"])
    assert result["data"]["measurements"]["measured_now"] == 0
    assert (out / "pi4" / "subnet.onnx").is_file()


@pytest.mark.slow
def test_federate_searches_on_the_measurements_beside_the_supernet_when_it_reads_all_of_server_val(tmp_path,
                                                                                                monkeypatch):
    """``rafl federate`` / ``rafl compare`` search on the supernet's whole server-val split (as
    ``rafl search`` does) take the measurements shipped beside it; on a subset they measure."""
    import rafl.stages.prepare as prep
    from rafl.federation.run_config import load_run_config

    torch.manual_seed(0)
    d = tmp_path / "supernet"
    save_supernet(d, build_supernet(SPACE), DATA_CFG, {})
    measure = SearchConfig(population=6, generations=2, top_k=2, seed=0, progress=False)  # rafl search's measurement
    write_measurements(d, samples=8, seed=0, workers=1, profiles=["pi4"], config=measure, say=lambda line: None,
                       progress=False)
    shipped = json.loads((d / pt.MEASUREMENTS_NAME).read_text())["accuracy"]
    seen: list = []
    real = prep.subnets_for_profiles

    def spy(*args, **kwargs):
        seen.append(kwargs.get("known"))
        return real(*args, **kwargs)

    monkeypatch.setattr(prep, "subnets_for_profiles", spy)
    for val_samples, want in ((100000, shipped), (16, None)):
        cfg = load_run_config(None, [f"supernet.path={d}", "data.dataset=digits", "data.resolution=32", "clients.n=3",
                                     "clients.profiles=[pi4]", "partition.public_fraction=0.3", "partition.public_seed=0",
                                     "search.population=6", "search.generations=2", "search.predictor_samples=8",
                                     f"search.val_samples={val_samples}", "engine.rounds=1"])
        prep.prepare(cfg, progress=False)
        assert seen[-1] == want


#: ``rafl search --supernet cifar10`` with pi4, jetson-nano and phone, the default options: the
#: picks README.md and docs/search.md show (bench/results/search_determinism.md)
DOCUMENTED_PICKS = {
    "pi4": "r28_k7e6.k3e6.k7e4.k5e3|k5e6.k7e6.k7e4.k5e6|k7e6.k5e4.k7e3|k5e4.k3e3|k7e3.k5e3",
    "jetson-nano": "r32_k5e6.k7e6.k7e6|k7e6.k7e6.k5e6.k5e6|k7e6.k7e4.k7e3|k5e6.k3e6|k7e6.k7e6",
    "phone": "r28_k7e6.k7e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6|k7e6.k7e4.k5e6.k7e6|k7e6.k3e6.k7e6.k7e6|k7e6.k7e6.k7e6.k7e6",
}


def _search_in_a_child(tmp: Path, threads: int, kernels: dict[str, str]) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAFL_DATA_ROOT", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")}
    env.update(kernels)
    tmp.mkdir()
    env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "RAFL_CACHE_DIR": str(tmp / "cache"),
                "HOME": str(tmp / "home"), "RAFL_DATA_ROOT": str(tmp / "no-data-here")})
    cmd = [sys.executable, "-m", "rafl", "search", "--supernet", "cifar10", "--out", str(tmp / "out"), "--quiet"]
    for name in DOCUMENTED_PICKS:
        cmd += ["--device-profile", name]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=600)
    return {name: json.loads((tmp / "out" / name / "result.json").read_text()) for name in DOCUMENTED_PICKS}


@pytest.mark.slow
@pytest.mark.integration
def test_the_shipped_search_picks_the_documented_subnets_on_any_kernels_and_thread_count(tmp_path):
    """A cold cache, no dataset, 1 thread on this CPU's own kernels and 2 threads on the AVX2-era
    kernels another CPU would use (torch, MKL and OpenBLAS told so): the same three picks, the
    documented ones, each a shipped finalist with its shipped accuracy."""
    doc = pt.supernet_measurements(pt.pretrained_path("cifar10"))
    runs = [_search_in_a_child(tmp_path / "native", 1, {}),
            _search_in_a_child(tmp_path / "avx2", 2, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                                      "OPENBLAS_CORETYPE": "Haswell"})]
    for run in runs:
        assert {name: r["arch_string"] for name, r in run.items()} == DOCUMENTED_PICKS
        for name, r in run.items():
            assert r["accuracy_source"] == "measured" and r["accuracy"] == doc["accuracy"][r["arch_string"]]
    assert [{n: r["top_k"] for n, r in run.items()} for run in runs[1:]] == [{n: r["top_k"] for n, r in runs[0].items()}]


def test_predictions_are_float64_rounded_to_the_grid():
    """The predictor trains and predicts in float64 and rounds to PREDICTION_DECIMALS: a last-bit
    change of its weights (what another CPU's kernels give) does not move a prediction."""
    import numpy as np

    from rafl.search.predictor import PREDICTION_DECIMALS, train_predictor

    rng = np.random.default_rng(0)
    x = rng.integers(0, 2, size=(64, 12)).astype(np.float64)
    y = 0.7 + 0.05 * x[:, :3].sum(1) / 3 + 0.001 * rng.standard_normal(64)
    model, _ = train_predictor(x, y, folds=0, hidden=16, epochs=50, seed=0)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    pred = model.predict(x)
    assert np.array_equal(pred, np.round(pred, PREDICTION_DECIMALS))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 2.0 ** -50)  # about 8 ulp of float64
    assert np.array_equal(model.predict(x), pred)


def test_a_search_into_a_folder_of_another_supernet_is_refused(tmp_path):
    from rafl.stages.search import check_same_supernet

    (tmp_path / "search.json").write_text(json.dumps({"supernet": "/somewhere/cifar10"}))
    check_same_supernet(tmp_path, "/somewhere/cifar10")  # the same supernet: fine
    check_same_supernet(tmp_path / "new", "/somewhere/cifar10")  # a new folder: fine
    with pytest.raises(UserInputError, match="holds subnets of the supernet /somewhere/cifar10") as err:
        check_same_supernet(tmp_path, "/elsewhere/quickstart")
    assert err.value.field == "--out"


@pytest.mark.slow
def test_the_headline_config_deploys_the_documented_subnets(shared_cifar10_tarball, monkeypatch):
    """``examples/cifar10-devices.yaml`` (the README's headline, seed 0) on a cold cache searches the
    subnets the README names (pi4 4.45, jetson-nano 6.38, phone 8.54 M MACs) from the shipped
    measurements, whatever the machine."""
    import rafl.stages.prepare as prep
    from rafl.federation.run_config import load_run_config

    seen: dict = {}
    real = prep.subnets_for_profiles

    def spy(*args, **kwargs):
        seen.update(real(*args, **kwargs))
        return seen

    monkeypatch.setattr(prep, "subnets_for_profiles", spy)
    cfg = load_run_config(Path(__file__).resolve().parents[1] / "examples" / "cifar10-devices.yaml",
                          [f"data.root={shared_cifar10_tarball}", "engine.rounds=1"])
    prep.prepare(cfg, progress=False)
    assert {name: rec["arch"].to_string() for name, rec in seen.items()} == DOCUMENTED_PICKS
