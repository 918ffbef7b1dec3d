"""Device profiles: shipped profiles load by name and path; every bad input is one clear error."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from rafl.errors import UserInputError
from rafl.search.cost import CostModel
from rafl.search.profile import DeviceProfile, list_profiles, load_profile, profiles_dir
from rafl.supernet.arch import SearchSpace

SHIPPED = ["jetson-nano", "mcu", "phone", "pi4", "server-gpu"]


def test_shipped_profiles_load_by_name_and_by_path():
    assert list_profiles() == SHIPPED
    for name in SHIPPED:
        by_name = load_profile(name)
        by_path = load_profile(profiles_dir() / f"{name}.yaml")
        assert by_name == by_path
        assert by_name.name == name
        assert by_name.source == profiles_dir() / f"{name}.yaml"
        assert by_name.throughput_gmacs > 0 and by_name.mem_bandwidth_gbs > 0
        assert by_name.has_energy_model


def test_every_shipped_figure_cites_a_source_in_a_comment():
    for name in SHIPPED:
        text = (profiles_dir() / f"{name}.yaml").read_text()
        keys = [line.split(":")[0] for line in text.splitlines()
                if line and not line.startswith((" ", "#")) and ":" in line]
        for key in ("throughput_gmacs", "mem_bandwidth_gbs", "train_ram_mb"):
            assert key in keys
            # the line before the figure (or a block above it) is a comment
            lines = text.splitlines()
            idx = next(i for i, line in enumerate(lines) if line.startswith(key + ":"))
            assert lines[idx - 1].startswith("#"), (name, key)


def test_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(UserInputError) as err:
        load_profile("pi5")
    msg = str(err.value)
    assert "pi5" in msg and all(n in msg for n in SHIPPED) and "\n" not in msg


def _write(tmp_path, data, name="dev.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


BASE = {"name": "dev", "throughput_gmacs": 5.0, "mem_bandwidth_gbs": 4.0, "avg_power_w": 3.0,
        "budgets": {"latency_ms": 2.0}}


@pytest.mark.parametrize(
    "mutate, field, allowed",
    [
        (lambda d: d.update(speed=3), "speed", "allowed keys"),                       # unknown key
        (lambda d: d["budgets"].update(latency_s=1), "budgets.latency_s", "latency_ms"),  # wrong unit
        (lambda d: d.update(throughput_gmacs="fast"), "throughput_gmacs", "GMAC/s"),  # wrong type
        (lambda d: d["budgets"].update(latency_ms=-1), "budgets.latency_ms", "> 0"),  # negative budget
        (lambda d: d["budgets"].update(macs_m=0), "budgets.macs_m", "> 0"),           # zero budget
        (lambda d: d.pop("mem_bandwidth_gbs"), "mem_bandwidth_gbs", "GB/s"),          # missing field
        (lambda d: d.update(batch_size=2.5), "batch_size", "integer"),                # not an integer
        (lambda d: d.update(batch_size=True), "batch_size", "integer"),               # a bool is no integer
        # infinite numbers passed as "no limit" / a free device (a search found latency 1.2 ms from overheads)
        (lambda d: d["budgets"].update(macs_m=float("inf")), "budgets.macs_m", "a finite number > 0"),
        (lambda d: d.update(throughput_gmacs=float("inf")), "throughput_gmacs", "a finite number > 0"),
        (lambda d: d.update(layer_overhead_us=float("nan")), "layer_overhead_us", "a finite number >= 0"),
    ],
)
def test_bad_profile_is_one_error_naming_file_field_and_allowed(tmp_path, mutate, field, allowed):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(UserInputError) as err:
        load_profile(path)
    msg = str(err.value)
    assert str(path) in msg and field in msg and allowed in msg and "\n" not in msg


def test_energy_budget_without_energy_model_and_half_a_pj_model_are_errors(tmp_path):
    data = {k: v for k, v in BASE.items() if k != "avg_power_w"}
    data["budgets"] = {"energy_mj": 1.0}
    with pytest.raises(UserInputError, match="energy model"):
        load_profile(_write(tmp_path, data))
    data = dict(BASE, energy_pj_per_mac=10.0)
    with pytest.raises(UserInputError, match="go together"):
        load_profile(_write(tmp_path, data))


def test_malformed_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserInputError, match="not valid YAML"):
        load_profile(bad)
    with pytest.raises(UserInputError, match="no such profile file"):
        load_profile(tmp_path / "nope.yaml")
    lst = _write(tmp_path, [1, 2], "list.yaml")
    with pytest.raises(UserInputError, match="expected a mapping"):
        load_profile(lst)


def test_train_ram_is_the_training_memory_limit_when_no_budget_is_given():
    p = DeviceProfile(name="x", throughput_gmacs=1, mem_bandwidth_gbs=1, train_ram_mb=100)
    assert dict(p.effective_budgets()) == {"train_memory_mb": 100}
    q = DeviceProfile(name="x", throughput_gmacs=1, mem_bandwidth_gbs=1, train_ram_mb=100,
                      budgets={"train_memory_mb": 50})
    assert dict(q.effective_budgets()) == {"train_memory_mb": 50}


@pytest.mark.slow
def test_budgets_give_different_feasible_sets_on_the_quickstart_space():
    """pi4 is tighter than jetson-nano, tighter than phone, tighter than server-gpu; mcu admits nothing."""
    for wm in (0.35, 0.5):  # the widths the budgets are derived for (the shipped supernets': 0.35)
        space = SearchSpace(width_mult=wm)
        rng = np.random.default_rng(0)
        archs = [space.smallest(), space.largest()] + [space.sample(rng) for _ in range(400)]
        feasible = {n: CostModel(space, n).feasible(archs) for n in SHIPPED}
        macs = CostModel(space).batch(archs)["macs_m"]
        best = {n: macs[m].max() for n, m in feasible.items() if m.any()}
        assert not feasible["mcu"].any()
        assert feasible["server-gpu"].sum() >= feasible["phone"].sum()
        for n in ("pi4", "jetson-nano", "phone"):
            assert feasible[n][0], f"{n}: the smallest subnet must fit at width {wm}"
        assert best["pi4"] < best["jetson-nano"] < best["phone"] <= best["server-gpu"], (wm, best)


def test_mcu_reports_clear_violations():
    space = SearchSpace(width_mult=0.5)
    model = CostModel(space, "mcu")
    msgs = model.violations(model.cost(space.smallest()))
    assert any(m.startswith("peak_memory_mb:") and "> budget" in m for m in msgs)
    assert any(m.startswith("params_m:") for m in msgs)


def test_booleans_are_not_numbers_in_a_profile(tmp_path):
    """YAML reads yes/true as True, which pydantic's lax mode would take as 1 (train_ram_mb: true
    was a 1 MiB device)."""
    import yaml

    base = yaml.safe_load((Path(load_profile("pi4").source)).read_text())
    for edit, field in ((lambda d: d.update(train_ram_mb=True), "train_ram_mb"),
                        (lambda d: d["budgets"].update(macs_m=True), "budgets.macs_m")):
        data = yaml.safe_load(yaml.safe_dump(base))
        edit(data)
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump(data))
        with pytest.raises(UserInputError, match=f"{field}: a boolean is not allowed here .got True .YAML reads"):
            load_profile(path)


def test_every_yaml_reader_refuses_duplicate_keys_naming_file_key_and_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a profile with ``name: b`` then ``name: c`` was
    device c without a word. Profiles, run configs, arch files, LUTs and --set values share
    :func:`rafl.io.load_yaml`, which refuses the repeat."""
    from click.testing import CliRunner

    from rafl.cli import cli
    from rafl.config import parse_overrides, read_config_file
    from rafl.io import load_yaml
    from rafl.search.latency import load_latency_lut
    from rafl.supernet.arch import ArchConfig

    prof = tmp_path / "p.yaml"
    prof.write_text("name: b\nthroughput_gmacs: 1\nmem_bandwidth_gbs: 1\nname: c\n")
    with pytest.raises(UserInputError, match=r"p\.yaml: duplicate key 'name' at line 4 \(first at line 1\)"):
        load_profile(prof)
    nested = tmp_path / "run.yaml"
    nested.write_text("engine:\n  rounds: 2\n  rounds: 3\n")
    with pytest.raises(UserInputError, match=r"run\.yaml: duplicate key 'rounds' at line 3 \(first at line 2\)"):
        read_config_file(nested)
    for reader in (ArchConfig.load, load_latency_lut):
        with pytest.raises(UserInputError, match="duplicate key 'name' at line 4"):
            reader(prof)
    with pytest.raises(UserInputError, match=r"--set: .*duplicate key 'a' at line 1"):
        parse_overrides(["algorithm={a: 1, a: 2}"])
    res = CliRunner().invoke(cli, ["profile", "--arch", "r24_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3",
                                   "--device-profile", str(prof), "--out", str(tmp_path / "out"), "--no-measure"])
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "duplicate key 'name'" in res.output, res.output
    assert not (tmp_path / "out").exists()
    # as yaml.safe_load otherwise: quoted numbers stay text, merge keys may be overridden
    assert load_yaml('a: "12"\nb: yes\nbase: &b {x: 1, y: 2}\nc:\n  <<: *b\n  x: 3\n') == {
        "a": "12", "b": True, "base": {"x": 1, "y": 2}, "c": {"x": 3, "y": 2}}
