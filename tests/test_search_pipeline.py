"""End to end: the real supernet (tiny width), the real cost model and the shipped profiles.

One small search (population 12 x 4 generations, 8 measured subnets for the predictor) over two
shipped profiles runs once per module; the tests check its files, that every budget is met
(re-checked with fvcore and the cost model), determinism, and the CLI's bad-input handling.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.search.cost import CostModel
from rafl.search.evolution import SearchConfig, search_subnets
from rafl.search.profile import load_profile
from rafl.stages.search import load_searched_subnet, run_search, server_eval_data
from rafl.supernet import build_supernet, save_supernet
from rafl.supernet.arch import ArchConfig, SearchSpace

SPACE = SearchSpace(width_mult=0.35)
DATA_CFG = {"dataset": "digits", "image_size": 32, "public_fraction": 0.3, "public_seed": 0, "val_fraction": 0.1}
PROFILES = ["pi4", "jetson-nano"]
TINY = dict(population=12, generations=4, predictor_samples=8, top_k=2, calib_batches=1, progress=False, seed=3)


@pytest.fixture(scope="module")
def supernet_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("supernet")
    save_supernet(d, build_supernet(SPACE), DATA_CFG, {})
    return d


@pytest.fixture(scope="module")
def searched(supernet_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("search") / "out"
    results = run_search(PROFILES, out, SearchConfig(**TINY), supernet_dir=supernet_dir)
    return out, results


@pytest.mark.slow
def test_every_profile_gets_a_complete_folder(searched, supernet_dir):
    out, results = searched
    assert list(results) == PROFILES
    # one predictor (one pass of measurements over the supernet) shared by both profiles
    assert results[PROFILES[0]].predictor_fit == results[PROFILES[1]].predictor_fit
    summary = json.loads((out / "search.json").read_text())
    assert set(summary["profiles"]) == set(PROFILES) and summary["data"]["n_val"] > 0
    for name in PROFILES:
        d = out / name
        for f in ("subnet.yaml", "subnet.safetensors", "subnet.onnx", "cost.json", "history.jsonl",
                  "pareto.json", "pareto.png", "result.json"):
            assert (d / f).is_file() and (d / f).stat().st_size > 0, f
        res = results[name]
        assert ArchConfig.load(d / "subnet.yaml", SPACE) == res.arch
        recorded = yaml.safe_load((d / "subnet.yaml").read_text())["supernet"]  # absolute: readable from anywhere
        assert Path(recorded).is_absolute() and Path(recorded) == Path(supernet_dir).resolve(), recorded
        history = [json.loads(line) for line in (d / "history.jsonl").read_text().splitlines()]
        assert [h["generation"] for h in history] == list(range(TINY["generations"]))
        assert all(a["best_accuracy"] <= b["best_accuracy"] for a, b in zip(history, history[1:]))
        result = json.loads((d / "result.json").read_text())
        assert result["arch_string"] == res.arch.to_string() and 0.0 <= result["accuracy"] <= 1.0
        assert result["onnx"]["onnx_checker"].startswith("passed")
        assert result["onnx"]["onnxruntime_max_rel_diff"] <= 1e-3
        fit = result["predictor_fit"]
        assert fit["n_holdout"] == 8 and fit["folds"] == 4
        assert np.isnan(fit["kendall_tau"]) or -1 <= fit["kendall_tau"] <= 1
        # the winner is the best *measured* of the re-measured top-k of every profile that fits
        shared = [c for c in result["shared_candidates"] if c["feasible"]]
        assert res.accuracy == max(t["accuracy"] for t in result["top_k"] + shared)
        assert result["found_for"] == res.found_for and result["searched_with"] == PROFILES
        assert summary["profiles"][name]["found_for"] == res.found_for
        pareto = json.loads((d / "pareto.json").read_text())
        for key in ("latency_ms", "macs_m"):
            front = pareto[f"accuracy_vs_{key}"]
            assert front and all(a[key] <= b[key] and a["accuracy"] < b["accuracy"] for a, b in zip(front, front[1:]))


def test_found_subnets_meet_every_budget_rechecked(searched):
    from fvcore.nn import FlopCountAnalysis

    logging.getLogger("fvcore").setLevel(logging.ERROR)
    out, results = searched
    for name, res in results.items():
        prof = load_profile(name)
        model = CostModel(SPACE, prof)
        cost = model.cost(res.arch)
        assert model.violations(cost, prof) == []
        assert cost == res.cost
        sub = load_searched_subnet(out / name)
        assert sub.arch == res.arch
        # fvcore counts MACs (1 multiply-add = 1 "flop"); the cost model counts conv + linear layers
        x = torch.zeros(1, 3, res.arch.r, res.arch.r)
        flops = FlopCountAnalysis(sub, x)
        flops.unsupported_ops_warnings(False)
        by_op = flops.by_operator()
        macs_m = (by_op["conv"] + by_op["linear"]) / 1e6
        assert macs_m == pytest.approx(cost.macs_m, rel=1e-6)
        if "macs_m" in dict(prof.effective_budgets()):
            assert macs_m <= dict(prof.effective_budgets())["macs_m"]
        assert sum(p.numel() for p in sub.parameters()) / 1e6 == pytest.approx(cost.params_m, rel=1e-6)


def test_no_profile_ends_below_a_finalist_it_can_run(searched):
    """Cross-profile sharing: every profile's pick is at least as accurate (measured) as every
    finalist of the other profile that meets all of its budgets (re-checked with the cost model)."""
    out, results = searched
    finalists = {name: [(ArchConfig.from_string(t["arch"], SPACE), t["accuracy"]) for t in res.top_k]
                 for name, res in results.items()}
    for name, res in results.items():
        prof = load_profile(name)
        model = CostModel(SPACE, prof)
        assert model.violations(model.cost(res.arch), prof) == []
        for other, cands in finalists.items():
            for arch, acc in cands:
                if not model.violations(model.cost(arch), prof):
                    assert res.accuracy >= acc, (name, other, arch.to_string())
        if res.found_for != name:  # taken from another profile's finalists: strictly better than its own
            assert res.arch in [a for a, _ in finalists[res.found_for]]
            assert res.accuracy > max(t["accuracy"] for t in res.top_k)
        summary = json.loads((out / "search.json").read_text())
        assert summary["profiles"][name]["found_for"] == res.found_for


@pytest.mark.slow
def test_second_search_into_the_same_out_keeps_search_json_complete(searched, supernet_dir, tmp_path):
    """A later `rafl search` into the same --out replaces only its own profiles' folders, and
    search.json lists every profile folder present (rebuilt from their result.json files)."""
    import shutil

    src, _ = searched
    out = tmp_path / "out"
    shutil.copytree(src, out)
    before = {n: (out / n / "result.json").read_text() for n in PROFILES}
    res = _run(["--device-profile", "phone", "--device-profile", PROFILES[1], "--supernet", str(supernet_dir),
                "--out", str(out),
                "--generations", "1", "--population", "4", "--predictor-samples", "4", "--top-k", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "search.json").read_text())
    assert list(summary["profiles"]) == ["phone", PROFILES[1], PROFILES[0]]  # this run's first, then the rest
    assert summary["latest_run"] == ["phone", PROFILES[1]]
    assert summary["config"]["population"] == 4
    assert (out / PROFILES[0] / "result.json").read_text() == before[PROFILES[0]]  # untouched
    assert (out / PROFILES[1] / "result.json").read_text() != before[PROFILES[1]]  # replaced
    for name, entry in summary["profiles"].items():
        result = json.loads((out / name / "result.json").read_text())
        assert entry["arch"] == result["arch_string"] and entry["accuracy"] == result["accuracy"]
        assert entry["dir"] == str((out / name).resolve()) and entry["latest_run"] == (name != PROFILES[0])
    assert summary["profiles"][PROFILES[0]]["searched_with"] == PROFILES
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_searched_subnet_yaml_profiles_without_supernet(searched, tmp_path):
    """`rafl profile --arch OUT/pi4/subnet.yaml` (no --supernet) profiles the arch in the space
    subnet.yaml records (here width 0.35), with the cost the search reported."""
    out, results = searched
    name = PROFILES[0]
    doc = yaml.safe_load((out / name / "subnet.yaml").read_text())
    assert doc["search_space"] == SPACE.to_dict() and Path(doc["supernet"]).is_dir()
    res = CliRunner().invoke(cli, ["profile", "--arch", str(out / name / "subnet.yaml"), "--device-profile", name,
                                   "--out", str(tmp_path / "p"), "--no-measure"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "p" / "cost_report.json").read_text())
    assert report["search_space"]["width_mult"] == SPACE.width_mult and report["feasible"] is True
    assert report["cost"]["macs_m"] == pytest.approx(results[name].cost.macs_m)


def test_onnx_export_runs_like_pytorch(searched):
    import onnxruntime as ort

    out, results = searched
    name = PROFILES[0]
    sub = load_searched_subnet(out / name)
    r = results[name].arch.r
    x = torch.randn(3, 3, r, r, generator=torch.Generator().manual_seed(1))
    sess = ort.InferenceSession(str(out / name / "subnet.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(["logits"], {"images": x.numpy()})[0]
    with torch.no_grad():
        want = sub(x).numpy()
    assert got.shape == (3, SPACE.n_classes)
    assert np.max(np.abs(got - want)) <= 1e-3 * max(1.0, np.max(np.abs(want)))


def test_measured_estimator_is_deterministic_end_to_end(supernet_dir):
    from rafl.supernet import load_supernet

    net = load_supernet(supernet_dir)
    val, calib, _ = server_eval_data(DATA_CFG, SPACE)
    cfg = SearchConfig(**{**TINY, "population": 4, "generations": 1, "estimator": "measured", "top_k": 1})
    runs = [search_subnets(net, ["jetson-nano"], val, calib, cfg)["jetson-nano"],
            # numpy arrays, as the docstring's "float32 arrays" allows (they crashed in .numel())
            search_subnets(net, ["jetson-nano"], (val[0].numpy(), val[1].numpy()), calib.numpy(), cfg)["jetson-nano"]]
    for res in runs:
        assert res.predictor_fit is None and res.accuracy == res.predicted_accuracy
    assert runs[0].arch == runs[1].arch and runs[0].accuracy == runs[1].accuracy
    assert [h["best_arch"] for h in runs[0].history] == [h["best_arch"] for h in runs[1].history]


def test_empty_validation_split_is_rejected(supernet_dir):
    from rafl.supernet import load_supernet

    net = load_supernet(supernet_dir)
    val, calib, _ = server_eval_data(DATA_CFG, SPACE)
    empty = (val[0][:0], val[1][:0])
    with pytest.raises(UserInputError, match="validation split is empty"):
        search_subnets(net, ["pi4"], empty, calib, SearchConfig(**TINY))
    with pytest.raises(UserInputError, match="val_fraction"):
        server_eval_data({**DATA_CFG, "val_fraction": 0.0}, SPACE)


# ---------------------------------------------------------------------- CLI
def _run(args: list[str]):
    return CliRunner().invoke(cli, ["search", *args], catch_exceptions=False)


def test_cli_unreachable_profile_stops_at_once_naming_budgets(supernet_dir, tmp_path):
    out = tmp_path / "out"
    res = _run(["--device-profile", "mcu", "--supernet", str(supernet_dir), "--out", str(out), "--quiet"])
    assert res.exit_code == 2
    msg = res.output.strip().splitlines()[-1]
    assert msg.startswith("error: mcu.budgets: no subnet") and "params_m <= 0.05" in msg
    smallest = CostModel(SPACE, load_profile("mcu")).cost(SPACE.smallest())
    assert f"{smallest.params_m:.4g}" in msg
    assert not out.exists()
    # the user's own file (a copy of mcu.yaml keeps the name mcu): named, not the shipped profile
    mine = tmp_path / "my-mcu.yaml"
    mine.write_text(Path(load_profile("mcu").source).read_text())
    res = _run(["--device-profile", str(mine), "--supernet", str(supernet_dir), "--out", str(out), "--quiet"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1].startswith(f"error: {mine}: mcu.budgets: no subnet")


def test_cli_bad_inputs_exit_2_and_write_nothing(supernet_dir, tmp_path):
    out = tmp_path / "out"
    res = _run(["--device-profile", "no-such-device", "--out", str(out)])
    assert res.exit_code == 2 and "shipped profiles" in res.output
    res = _run(["--device-profile", "pi4", "--time-budget", "nan", "--out", str(out)])  # click's range lets NaN in
    assert res.exit_code == 2 and "'--time-budget': nan is not a finite number" in res.output
    bad = tmp_path / "bad.yaml"
    data = yaml.safe_load((Path(load_profile("pi4").source)).read_text())
    data["budgets"]["latency_ms"] = -1
    bad.write_text(yaml.safe_dump(data))
    res = _run(["--device-profile", str(bad), "--supernet", str(supernet_dir), "--out", str(out)])
    assert res.exit_code == 2 and "budgets.latency_ms" in res.output
    # a checkpoint that does not match its search space (the JSON claims another width)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    for f in supernet_dir.iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    meta = json.loads((wrong / "supernet.json").read_text())
    meta["search_space"]["width_mult"] = 0.5
    (wrong / "supernet.json").write_text(json.dumps(meta))
    res = _run(["--device-profile", "pi4", "--supernet", str(wrong), "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and "error:" in res.output
    # an empty validation split
    empty = tmp_path / "empty-val"
    empty.mkdir()
    for f in supernet_dir.iterdir():
        (empty / f.name).write_bytes(f.read_bytes())
    meta = json.loads((empty / "supernet.json").read_text())
    meta["config"]["val_fraction"] = 0.0
    (empty / "supernet.json").write_text(json.dumps(meta))
    res = _run(["--device-profile", "pi4", "--supernet", str(empty), "--out", str(out), "--quiet"])
    assert res.exit_code == 2 and "validation split is empty" in res.output
    res = _run(["--device-profile", "pi4", "--supernet", str(tmp_path / "missing"), "--out", str(out)])
    assert res.exit_code == 2 and "--supernet" in res.output
    assert not out.exists()


@pytest.mark.slow
def test_cli_small_search(supernet_dir, tmp_path):
    out = tmp_path / "out"
    res = _run(["--device-profile", "jetson-nano", "--supernet", str(supernet_dir), "--out", str(out),
                "--generations", "1", "--population", "4", "--predictor-samples", "4", "--top-k", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "jetson-nano: r" in res.output and "Kendall tau" in res.output
    assert (out / "jetson-nano" / "subnet.onnx").is_file()


def test_search_json_records_profile_folders_absolute(tmp_path, monkeypatch):
    """search.json's ``dir`` was relative to the folder the search ran from (``s1/pi4``), unlike
    every other recorded path."""
    from rafl.stages.search import write_search_index

    (tmp_path / "s1" / "pi4").mkdir(parents=True)
    (tmp_path / "s1" / "pi4" / "result.json").write_text(json.dumps({"arch_string": "x", "accuracy": 0.5}))
    (tmp_path / "s1" / "mcu").mkdir()
    (tmp_path / "s1" / "mcu" / "result.json").write_text("[]")
    monkeypatch.chdir(tmp_path)
    doc = write_search_index("s1", {"supernet": "sn"}, ["pi4"])
    for name in ("pi4", "mcu"):
        assert doc["profiles"][name]["dir"] == str((tmp_path / "s1" / name).resolve())
    assert json.loads((tmp_path / "s1" / "search.json").read_text()) == doc


@pytest.mark.slow
def test_common_search_finds_one_subnet_for_budgets_that_are_not_nested(supernet_dir):
    """The common search (one model for every device) meets both devices' budgets at once (one
    bounds MACs, the other peak memory) and leaves each profile's own pick as it is without it;
    uniform takes it when no profile's subnet fits every device."""
    from rafl.search.evolution import COMMON
    from rafl.search.federation_search import uniform_arch
    from rafl.supernet import load_supernet

    net = load_supernet(supernet_dir)
    val, calib, _ = server_eval_data(DATA_CFG, SPACE)
    small, large = SPACE.smallest(), SPACE.largest()
    a, b = load_profile("pi4"), load_profile("jetson-nano")
    cost_a, cost_b = CostModel(SPACE, a), CostModel(SPACE, b)
    a = a.with_budgets({"macs_m": (cost_a.cost(small).macs_m + cost_a.cost(large).macs_m) / 2})
    b = b.with_budgets({"peak_memory_mb": (cost_b.cost(small).peak_memory_mb + cost_b.cost(large).peak_memory_mb) / 2})
    cfg = SearchConfig(**TINY)
    alone = search_subnets(net, [a, b], val, calib, cfg)
    both = search_subnets(net, [a, b], val, calib, cfg, common=True)
    assert [both[p.name].arch for p in (a, b)] == [alone[p.name].arch for p in (a, b)]
    one = both[COMMON].arch
    for p in (a, b):
        cm = CostModel(SPACE, p)
        assert cm.violations(cm.cost(one), p) == []
    # profiles' subnets that each break a budget of the other device: uniform takes the common one
    over = {"arch": large, "search_accuracy": 0.9}
    arch_of = {a.name: over, b.name: over, COMMON: {"arch": one, "search_accuracy": both[COMMON].accuracy}}
    assert uniform_arch(SPACE, arch_of, [a, b]) == {"arch": one, "source": "uniform: the subnet searched for every "
                                                                           "profile's budgets"}
    # with a profile's subnet fitting every device (nested budgets), that one, as before
    arch_of[b.name] = {"arch": small, "search_accuracy": 0.5}
    assert uniform_arch(SPACE, arch_of, [a, b])["arch"] == small
