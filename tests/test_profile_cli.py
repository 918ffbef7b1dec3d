"""``rafl profile``: the report (Markdown + JSON + PNG), --model inputs, --build-lut, bad input -> exit 2."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.supernet.arch import SearchSpace

SPACE = SearchSpace(width_mult=0.25)
ARCH = "r24_k3e3.k5e4|k7e6.k3e3|k3e3.k3e3.k5e3|k3e4.k3e3|k3e3.k3e6"


def _run(args):
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def test_report_has_every_section_and_consistent_numbers(tmp_path):
    out = tmp_path / "report"
    res = _run(["profile", "--arch", ARCH, "--width-mult", "0.25", "--device-profile", "pi4", "--out", str(out),
                "--warmup", "1", "--repeats", "3", "--batch-size", "4"])
    assert res.exit_code == 0, res.output
    assert "on pi4" in res.output and "feasible" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["cost_report.json", "cost_report.md", "cost_report.png"]
    assert (out / "cost_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "cost_report.json").read_text())
    md = (out / "cost_report.md").read_text()
    for section in ("## Summary", "## Budgets", "## Per-layer costs", "## Why fvcore and thop differ",
                    "## Measured latency on this host", "cost_report.png"):
        assert section in md
    layers = doc["layers"]
    assert [d["name"] for d in layers][:2] == ["first_conv", "blocks.0"] and layers[-1]["name"] == "head"
    assert len(layers) == 2 + 11 + 3  # stem + first block, 11 active blocks, final expand / mix / head
    total = sum(d["macs_conv_linear"] for d in layers)
    assert total == pytest.approx(doc["cost"]["macs_m"] * 1e6)
    # fvcore and thop agree with the LUT on conv + linear and count BN on top of it
    by_op = doc["totals"]["fvcore_by_operator"]
    assert by_op["conv"] + by_op["linear"] == pytest.approx(total, rel=0.01)
    assert doc["totals"]["macs_thop"] > total and doc["totals"]["macs_fvcore"] > total
    assert sum(d["latency_ms"] for d in layers) == pytest.approx(doc["cost"]["latency_ms"])
    assert doc["cost"]["flops_m"] == pytest.approx(2 * doc["cost"]["macs_m"])
    host = doc["host_latency"]
    assert host["batch_1"]["median_ms"] > 0 and host["batch_4"]["batch_size"] == 4
    assert host["batch_1"]["p90_ms"] >= host["batch_1"]["median_ms"]
    budgets = {b["budget"]: b for b in doc["budgets"]}
    assert set(budgets) == {"macs_m", "latency_ms", "peak_memory_mb", "train_memory_mb", "energy_mj"}
    assert all(b["passed"] == (b["value"] <= b["limit"]) for b in budgets.values())


@pytest.mark.slow
def test_mcu_is_reported_infeasible_and_model_inputs(tmp_path):
    from rafl.stages.search import save_subnet_weights
    from rafl.supernet import subnet_from_arch
    from rafl.supernet.arch import ArchConfig

    arch = ArchConfig.from_string(ARCH, SPACE)
    torch.manual_seed(0)
    sub = subnet_from_arch(SPACE, arch)
    st = tmp_path / "subnet.safetensors"
    save_subnet_weights(st, sub, SPACE)
    res = _run(["profile", "--model", str(st), "--device-profile", "mcu", "--out", str(tmp_path / "a"),
                "--no-measure"])
    assert res.exit_code == 0, res.output
    assert "INFEASIBLE" in res.output and "peak_memory_mb" in res.output
    doc = json.loads((tmp_path / "a" / "cost_report.json").read_text())
    assert doc["feasible"] is False and doc["host_latency"] == {}
    # a .pt state dict with --arch (loaded with weights_only=True)
    pt = tmp_path / "subnet.pt"
    torch.save(sub.state_dict(), pt)
    arch_file = tmp_path / "arch.yaml"
    arch.save(arch_file)
    res = _run(["profile", "--model", str(pt), "--arch", str(arch_file), "--width-mult", "0.25",
                "--device-profile", "phone", "--out", str(tmp_path / "b"), "--no-measure"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "b" / "cost_report.json").read_text())["arch"] == arch.to_dict()
    # the same weights at another width: the error names the first mismatching tensor
    res = _run(["profile", "--model", str(pt), "--arch", str(arch_file), "--width-mult", "0.5",
                "--device-profile", "phone", "--out", str(tmp_path / "c"), "--no-measure"])
    assert res.exit_code == 2 and "at width x0.5: size mismatch for " in res.output, res.output


@pytest.mark.parametrize("args, needle", [
    (["--arch", ARCH, "--device-profile", "pi5"], "shipped profiles"),
    (["--arch", "missing.yaml", "--device-profile", "pi4"], "no such file"),
    (["--arch", "r40_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3", "--device-profile", "pi4"], "r: is 40"),
    (["--device-profile", "pi4"], "--arch"),
    (["--arch", ARCH, "--model", "x.safetensors", "--device-profile", "pi4"], "drop --arch"),
    (["--model", "nope.pt", "--device-profile", "pi4"], "no such file"),
    (["--build-lut", "--device-profile", "pi4"], ".yaml"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, needle):
    out = tmp_path / "out"
    res = CliRunner().invoke(cli, ["profile", *args, "--width-mult", "0.25", "--out", str(out), "--no-measure"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
    assert not out.exists()


def test_pt_without_arch_and_foreign_out_folder(tmp_path):
    pt = tmp_path / "w.pt"
    torch.save({"a": torch.zeros(1)}, pt)
    res = CliRunner().invoke(cli, ["profile", "--model", str(pt), "--device-profile", "pi4", "--out",
                                   str(tmp_path / "o")])
    assert res.exit_code == 2 and "needs --arch" in res.output
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    res = CliRunner().invoke(cli, ["profile", "--arch", ARCH, "--width-mult", "0.25", "--device-profile", "pi4",
                                   "--out", str(busy)])
    assert res.exit_code == 2 and "not `rafl profile` output (keep.txt)" in res.output and (busy / "keep.txt").exists()


@pytest.mark.slow
def test_build_lut_measures_every_layer_and_a_profile_uses_it(tmp_path):
    space = SearchSpace(width_mult=0.25)
    lut = tmp_path / "host-lut.yaml"
    res = _run(["profile", "--build-lut", "--device-profile", "pi4", "--width-mult", "0.25", "--out", str(lut),
                "--warmup", "0", "--repeats", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    doc = yaml.safe_load(lut.read_text())
    assert doc["device_profile"] == "pi4" and doc["threads"] == 1 and doc["search_space"] == space.to_dict()
    from rafl.search.cost import CostModel
    from rafl.search.profile import load_profile
    from rafl.search.units import arch_units

    prof_path = tmp_path / "host.yaml"
    prof_path.write_text(yaml.safe_dump({"name": "host", "throughput_gmacs": 1.0, "mem_bandwidth_gbs": 1.0,
                                         "latency_lut": lut.name, "budgets": {"latency_ms": 1000.0}}))
    model = CostModel(space, load_profile(prof_path))
    rng = __import__("numpy").random.default_rng(0)
    for arch in (space.smallest(), space.largest(), space.sample(rng)):  # every layer of the space is in it
        corr = doc.get("network_correction") or {"a": 1.0, "b_ms": 0.0}  # --calibrate's whole-network fit
        expected = corr["a"] * sum(doc["entries"][s.key] for _, s in arch_units(space, arch)) + corr["b_ms"]
        assert model.cost(arch).latency_ms == pytest.approx(expected)
    # --out over an existing file: an earlier LUT is rebuilt, anything else (here the profile) is kept
    before = prof_path.read_text()
    res = _run(["profile", "--build-lut", "--device-profile", str(prof_path), "--width-mult", "0.25",
                "--out", str(prof_path), "--warmup", "0", "--repeats", "1", "--quiet"])
    assert res.exit_code == 2 and "exists and is not a latency LUT" in res.output and prof_path.read_text() == before
    res = _run(["profile", "--build-lut", "--device-profile", "pi4", "--width-mult", "0.25", "--out", str(lut),
                "--warmup", "0", "--repeats", "1", "--quiet"])
    assert res.exit_code == 0, res.output


def test_build_lut_on_timings_that_fall_with_size_writes_a_usable_lut_and_warns(tmp_path, monkeypatch):
    """A loaded host can time larger subnets as faster: the two-term network correction's slope is
    then <= 0, so ``a x sum`` alone is fitted, the LUT loads, and the command warns."""
    from rafl.search import latency

    def size(module):
        return sum(p.numel() for p in module.parameters())

    def timed(modules, warmup, repeats, now, statistic, progress, desc):  # deterministic "noisy" host
        if desc == "whole subnets":
            return [50.0 - 1e-4 * size(m) for m, _ in modules]
        return [0.01 + 1e-5 * size(m) for m, _ in modules]

    monkeypatch.setattr(latency, "_time_round_robin", timed)
    lut = tmp_path / "lut.yaml"
    res = CliRunner().invoke(cli, ["profile", "--build-lut", "--device-profile", "pi4", "--width-mult", "0.25",
                                   "--out", str(lut), "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    corr = yaml.safe_load(lut.read_text())["network_correction"]
    assert corr["a"] > 0 and corr["b_ms"] == 0.0 and "two-term fit gave" in corr["method"]
    assert "warning: network_correction:" in res.output
    assert latency.latency_lut_correction(lut) == (corr["a"], 0.0)


def test_supernet_folder_gives_the_space(tmp_path):
    from rafl.supernet import build_supernet, save_supernet

    torch.manual_seed(0)
    save_supernet(tmp_path / "sn", build_supernet(SPACE), {}, {})
    res = _run(["profile", "--supernet", str(tmp_path / "sn"), "--arch", ARCH, "--device-profile", "server-gpu",
                "--out", str(tmp_path / "r"), "--no-measure"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r" / "cost_report.json").read_text())
    assert doc["search_space"]["width_mult"] == 0.25 and doc["feasible"] is True
    res = CliRunner().invoke(cli, ["profile", "--supernet", str(tmp_path / "none"), "--arch", ARCH,
                                   "--device-profile", "pi4", "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--supernet" in res.output and not (tmp_path / "x").exists()


def test_shipped_supernet_by_name_gives_its_space(tmp_path):
    """`rafl profile --supernet cifar10` takes the shipped supernet by name, as `rafl search` does
    (its space: width x0.35), not as a folder named cifar10 here."""
    from rafl.supernet.pretrained import pretrained_path

    space = SearchSpace.from_dict(json.loads((pretrained_path("cifar10") / "supernet.json").read_text())["search_space"])
    res = _run(["profile", "--supernet", "cifar10", "--arch", ARCH, "--device-profile", "pi4",
                "--out", str(tmp_path / "r"), "--no-measure"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "r" / "cost_report.json").read_text())
    assert doc["search_space"]["width_mult"] == space.width_mult == 0.35
    assert doc["search_space"]["n_classes"] == space.n_classes
    # --build-lut measures the same space (stages.profile.load_space resolves the name for both)
    from rafl.stages.profile import load_space

    got, supernet = load_space("cifar10")
    assert got == space and supernet is not None


def test_nan_width_is_a_usage_error_not_a_traceback(tmp_path):
    res = CliRunner().invoke(cli, ["profile", "--arch", ARCH, "--device-profile", "pi4", "--width-mult", "nan",
                                   "--out", str(tmp_path / "out"), "--no-measure"])
    assert res.exit_code == 2 and "'--width-mult': nan is not a finite number" in res.output, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value, needle", [
    ("--width-mult", "1e9", "'--width-mult': 1000000000.0 is not in the range 0.1<=x<=2.0"),  # was a torch overflow
    ("--width-mult", "0.001", "'--width-mult': 0.001 is not in the range 0.1<=x<=2.0"),  # was every layer at 8 channels
    ("--n-classes", "100000000", "'--n-classes': 100000000 is not in the range 2<=x<=100000"),  # was a 512 GB head
])
def test_width_and_classes_out_of_bounds_are_one_line_exit_2(tmp_path, option, value, needle):
    res = CliRunner().invoke(cli, ["profile", "--no-measure", "--arch", ARCH, "--device-profile", "pi4",
                                   option, value, "--out", str(tmp_path / "out")])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_search_space_shares_the_bounds():
    from rafl.errors import UserInputError
    from rafl.supernet.train import TrainConfig

    for kwargs, needle in (({"width_mult": 0.05}, "width_mult: is 0.05; allowed: a number in 0.1..2"),
                           ({"width_mult": 1e9}, "width_mult: is 1000000000.0; allowed"),
                           ({"n_classes": 10**8}, "n_classes: is 100000000; allowed: an integer in 2..100000")):
        with pytest.raises(UserInputError, match=needle):
            SearchSpace(**kwargs)
    SearchSpace(width_mult=0.1, n_classes=100_000), SearchSpace(width_mult=2.0, n_classes=2)
    with pytest.raises(ValueError, match="width_mult"):
        TrainConfig(width_mult=0.05)


@pytest.mark.slow
def test_search_subnet_yaml_carries_its_space_else_the_error_says_pass_supernet(tmp_path):
    """A subnet.yaml from `rafl search` records its search space: `rafl profile --arch subnet.yaml`
    uses it without --supernet (here a 16 px space the default 24-32 px one rejects); an arch file
    without one, outside the default space, fails naming --supernet DIR."""
    from rafl.stages.search import write_subnet_yaml
    from rafl.supernet import build_supernet, save_supernet
    from rafl.supernet.arch import ArchConfig

    space = SearchSpace(width_mult=0.25, resolutions=(12, 16))
    arch = space.smallest()
    run = tmp_path / "search" / "pi4"
    run.mkdir(parents=True)
    write_subnet_yaml(run / "subnet.yaml", arch, space, "runs/sn16")
    assert ArchConfig.load(run / "subnet.yaml", space) == arch  # still a plain arch file
    res = _run(["profile", "--arch", str(run / "subnet.yaml"), "--device-profile", "pi4", "--out",
                str(tmp_path / "p"), "--no-measure"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "p" / "cost_report.json").read_text())
    assert doc["search_space"] == space.to_dict()
    # an explicit --width-mult that contradicts the recorded space is an error, not a silent override
    res = CliRunner().invoke(cli, ["profile", "--arch", str(run / "subnet.yaml"), "--width-mult", "1.0",
                                   "--device-profile", "pi4", "--out", str(tmp_path / "w"), "--no-measure"])
    assert res.exit_code == 2 and "--width-mult" in res.output and "0.25" in res.output, res.output
    # --supernet with another space than recorded: an error naming the recorded supernet
    torch.manual_seed(0)
    save_supernet(tmp_path / "sn32", build_supernet(SPACE), {}, {})
    res = CliRunner().invoke(cli, ["profile", "--arch", str(run / "subnet.yaml"), "--supernet", str(tmp_path / "sn32"),
                                   "--device-profile", "pi4", "--out", str(tmp_path / "s"), "--no-measure"])
    assert res.exit_code == 2 and "runs/sn16" in res.output and "--supernet" in res.output, res.output
    assert not (tmp_path / "w").exists() and not (tmp_path / "s").exists()
    # a bare arch file (no recorded space, nothing beside it): the error says to pass --supernet DIR
    bare = tmp_path / "bare.yaml"
    arch.save(bare)
    res = CliRunner().invoke(cli, ["profile", "--arch", str(bare), "--device-profile", "pi4", "--out",
                                   str(tmp_path / "b"), "--no-measure"])
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "r: is 12, allowed: one of 24, 28, 32" in lines[0] and "pass --supernet DIR" in lines[0]
    assert not (tmp_path / "b").exists()
    # an older search's subnet.yaml (no space inside): the result.json beside it records the space
    old = tmp_path / "old" / "pi4"
    old.mkdir(parents=True)
    arch.save(old / "subnet.yaml")
    (old / "result.json").write_text(json.dumps({"arch": arch.to_dict(), "search_space": space.to_dict(),
                                                 "supernet": "runs/sn16"}))
    res = _run(["profile", "--arch", str(old / "subnet.yaml"), "--device-profile", "pi4", "--out",
                str(tmp_path / "o"), "--no-measure"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "o" / "cost_report.json").read_text())["search_space"] == space.to_dict()


def test_a_lut_out_that_cannot_take_a_lut_is_refused_before_any_measuring(tmp_path):
    """Binary bytes, a folder, a parent that is a file: each one error naming --out (no traceback, no
    minutes of measuring first); a new path (any case of the suffix) and an earlier LUT pass."""
    from rafl.search.profile import LUT_FORMAT
    from rafl.stages.profile_checks import check_lut_out

    (tmp_path / "binary.yaml").write_bytes(bytes(range(128, 256)))
    (tmp_path / "folder.yaml").mkdir()
    (tmp_path / "file").write_text("x\n")
    for out, says in ((tmp_path / "binary.yaml", "is not a latency LUT"), (tmp_path / "folder.yaml", "is a folder"),
                      (tmp_path / "file" / "lut.yaml", "is a file"), (tmp_path / "lut.txt", "must end in .yaml")):
        with pytest.raises(UserInputError, match=says) as err:
            check_lut_out(out)
        assert err.value.field == "--out"
    (tmp_path / "old.yaml").write_text(f"format: {LUT_FORMAT}\nentries: {{}}\n")
    for out in (tmp_path / "old.yaml", tmp_path / "new" / "LUT.YAML"):
        check_lut_out(out)
    assert not (tmp_path / "new").exists()  # nothing made by the check
