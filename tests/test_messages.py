"""What a newcomer reads: YAML errors with line and column, truncated files named as truncated (with how
to recover), option slips answered with the right spelling, shipped names found from any folder,
``--show-config`` / ``--list-algorithms``, margins and accuracies printed so they do not mislead."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError


def _one_error_line(res):
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_a_run_config_with_bad_indentation_names_line_and_column(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("engine:\n  rounds: 3\n seed: 1\n")
    line = _one_error_line(CliRunner().invoke(cli, ["federate", "--config", str(bad), "--out", str(tmp_path / "o")]))
    assert line == (f"error: {bad}: not valid YAML at line 3, column 2: expected <block end>, but found "
                    "'<block mapping start>' (while parsing a block mapping at line 1)")


def test_profile_and_arch_files_name_line_and_column(tmp_path):
    from rafl.search.profile import load_profile
    from rafl.supernet.arch import ArchConfig

    bad = tmp_path / "board.yaml"
    bad.write_text("name: board\nthroughput_gmacs: [1, 2\n")
    with pytest.raises(UserInputError, match=r"board.yaml: not valid YAML at line 3, column 1: expected ',' or "
                                             r"'\]', but got '<stream end>' \(while parsing a flow sequence at line 2\)"):
        load_profile(bad)
    arch = tmp_path / "arch.yaml"
    arch.write_text("ks: [3, 3\nr: 16\n")
    with pytest.raises(UserInputError, match=r"arch.yaml: not valid YAML/JSON at line 2, column 2"):
        ArchConfig.load(arch)


@pytest.mark.parametrize("args, expected", [
    (["federate", "--rounds", "3"], "error: no such option: --rounds; run-config keys are set with --set, e.g. "
                                    "--set engine.rounds=3 (see 'rafl federate --help')"),
    (["federate", "--local-epochs=1"], "e.g. --set algorithm.local_epochs=1 (see 'rafl federate --help')"),
    (["compare", "--algorithms", "standalone", "--clients-per-round", "0.5"], "--set engine.clients_per_round=0.5"),
    # a name that is no config key keeps click's own suggestion
    (["federate", "--outt", "x"], "error: No such option '--outt'. (Did you mean one of: '--out', "),
])
def test_an_option_that_is_a_config_key_suggests_set(args, expected):
    assert expected in _one_error_line(CliRunner().invoke(cli, args, prog_name="rafl"))


def test_show_config_prints_the_resolved_config_as_a_loadable_file(tmp_path):
    from rafl.federation.run_config import load_run_config

    res = CliRunner().invoke(cli, ["federate", "--show-config", "--set", "engine.rounds=3",
                                   "--set", "algorithm.name=fedtgp", "--set", "clients.models=htfe-tiny"])
    assert res.exit_code == 0, res.output
    assert "  rounds: 3   # an integer >= 1\n" in res.output
    assert "  tau: 100.0\n" in res.output  # the method's hyperparameters, resolved
    shown_file = tmp_path / "shown.yaml"
    shown_file.write_text(res.output)
    again = load_run_config(shown_file)  # comments and all: a run config
    assert again.resolved() == load_run_config(None, ["engine.rounds=3", "algorithm.name=fedtgp",
                                                      "clients.models=htfe-tiny"]).resolved()
    assert "--show-config: cannot be combined with --resume" in _one_error_line(
        CliRunner().invoke(cli, ["federate", "--show-config", "--resume", str(tmp_path)]))


def test_list_algorithms_names_every_method_and_its_hyperparameters():
    from rafl.federation.algorithms import ALGORITHMS

    res = CliRunner().invoke(cli, ["federate", "--list-algorithms"])
    assert res.exit_code == 0, res.output
    names = [ln.split(":")[0] for ln in res.output.splitlines() if not ln.startswith(" ")]
    assert names == sorted(ALGORITHMS)
    assert "fedtgp: FedTGP (Zhang et al., AAAI 2024)." in res.output
    assert "fedavg: FedAvg (McMahan et al. 2017, Alg. 1). Needs identical client models." in res.output
    assert "tau=100.0" in res.output
    helptext = CliRunner().invoke(cli, ["federate", "--help"]).output
    assert "--list-algorithms" in helptext and "--show-config" in helptext and "examples/*.yaml" in helptext


def _saved_state_bytes():
    import torch

    from rafl.federation.store import state_to_bytes

    return state_to_bytes({"w": torch.arange(1000, dtype=torch.float32), "round": 2})


def test_a_truncated_run_checkpoint_says_so_and_how_to_recover(tmp_path):
    run_dir = tmp_path / "runs" / "rafl-digits-1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed": 0}))
    (run_dir / "metrics.jsonl").write_text('{"round": 1}\n{"round": 2}\n')
    data = _saved_state_bytes()
    (run_dir / "checkpoint.safetensors").write_bytes(data[:len(data) // 2])
    line = _one_error_line(CliRunner().invoke(cli, ["federate", "--resume", str(run_dir)]))
    ck = run_dir / "checkpoint.safetensors"
    assert line.startswith(f"error: {ck}: --resume: is truncated: {len(data) // 2:,} of {len(data):,} bytes, so the "
                           "run cannot continue from it (metrics.jsonl records 2 complete round(s)")
    assert line.endswith(f"start the run again: rafl federate --config {run_dir / 'config.yaml'} --out "
                         f"{run_dir.parent} --set name=rafl-digits-1-2")


def test_a_truncated_client_state_says_truncated(tmp_path):
    from rafl.federation.store import load_state

    data = _saved_state_bytes()
    path = tmp_path / "0000001.r00002.st"
    path.write_bytes(data[:100])
    with pytest.raises(UserInputError, match=r"cannot load state: truncated: 100 bytes, but its safetensors header "
                                             r"alone is [\d,]+ bytes"):
        load_state(path)


def test_a_truncated_subnet_file_says_truncated_and_how_to_redo_it(tmp_path, tiny_supernet):
    from rafl.stages.search import load_searched_subnet, save_subnet_weights
    from rafl.supernet import subnet_from_arch

    _, space = tiny_supernet
    path = tmp_path / "subnet.safetensors"
    save_subnet_weights(path, subnet_from_arch(space, space.smallest()), space)
    full = path.read_bytes()
    path.write_bytes(full[:-1000])
    with pytest.raises(UserInputError, match=rf"subnet.safetensors: truncated: {len(full) - 1000:,} of {len(full):,} "
                                             r"bytes \(an interrupted copy or a full disk\?\); copy it again, or "
                                             r"rerun rafl search"):
        load_searched_subnet(path)
    path.write_bytes(b"x" * 4000)
    with pytest.raises(UserInputError, match="not a rafl subnet file"):
        load_searched_subnet(path)


def test_a_shipped_profile_file_name_works_from_any_folder(tmp_path, monkeypatch):
    from rafl.federation.run_config import load_run_config
    from rafl.search.profile import load_profile

    monkeypatch.chdir(tmp_path)
    assert load_profile("pi4.yaml").name == "pi4"
    # recorded as the shipped name, so a resume from a folder holding another pi4.yaml reads the same profile
    assert load_run_config(None, ["clients.profiles=[pi4.yaml, phone]"]).clients.profiles == ["pi4", "phone"]
    mine = dict(yaml.safe_load(load_profile("pi4").source.read_text()), name="my-pi4")
    (tmp_path / "pi4.yaml").write_text(yaml.safe_dump(mine))  # a file of that name here wins
    assert load_profile("pi4.yaml").name == "my-pi4"
    with pytest.raises(UserInputError, match="pi5.yaml: no such profile file"):
        load_profile("pi5.yaml")


def test_build_lut_defaults_to_the_quickstart_space(tmp_path):
    from rafl.supernet.quickstart import quickstart_space

    lut = tmp_path / "lut.yaml"
    res = CliRunner().invoke(cli, ["profile", "--build-lut", "--device-profile", "pi4", "--out", str(lut),
                                   "--warmup", "0", "--repeats", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "no --supernet: measuring the quickstart supernet's space (width x0.35, 10 classes, 12/14/16 px)" \
        in res.output
    assert yaml.safe_load(lut.read_text())["search_space"] == quickstart_space().to_dict()


def test_supernet_quickstart_names_the_cached_folder(tmp_path):
    from rafl.supernet.checkpoint import META_NAME
    from rafl.supernet.quickstart import quickstart_dir, supernet_path

    with pytest.raises(UserInputError, match=r"--supernet: the quickstart supernet is not trained yet \(it will "
                                             r"be cached in .*quickstart-supernet-[0-9a-f]{12}\)"):
        supernet_path("quickstart", "--supernet")
    folder = quickstart_dir()
    folder.mkdir(parents=True)
    (folder / META_NAME).write_text("{}")
    assert supernet_path("quickstart") == folder
    assert supernet_path(tmp_path / "mine") == tmp_path / "mine"


def test_a_margin_far_over_the_limit_prints_as_a_ratio():
    from rafl.search.cost import BudgetCheck

    assert BudgetCheck("train_memory_mb", 21.57, 0.0625, False, (0.0625 - 21.57) / 0.0625).margin_text() \
        == "345x the limit"
    assert BudgetCheck("latency_ms", 3.2, 1.5, False, (1.5 - 3.2) / 1.5).margin_text() == "over by 113.3%"
    assert BudgetCheck("macs_m", 4.8, 10, True, 0.52).margin_text() == "52.0% headroom"


def test_binomial_standard_error_and_the_table_beside_the_test_count(capsys, tmp_path):
    from rafl.cli.federate import print_table
    from rafl.reports.tables import binomial_se

    assert binomial_se(0.75, 4) == pytest.approx(((0.75 * 0.25) / 4) ** 0.5)
    assert binomial_se(1.0, 4) == 0.0
    rows = [{"client": 0, "profile": "pi4", "macs_m": 0.7, "params_m": 0.3, "n_train": 30, "n_test": 4,
             "model.acc": 0.75, "arch": "a"},
            {"client": 1, "profile": "phone", "macs_m": 1.2, "params_m": 0.4, "n_train": 90, "n_test": 16,
             "model.acc": 1.0, "arch": "b"}]
    summary = {"table": rows, "algorithm": "standalone", "rounds": 1,
               "means": {"macs_m": 0.95, "params_m": 0.35, "model.acc": 0.875},
               "final": {}, "cum_mb": 0.0, "cum_bytes_up": 0, "cum_bytes_down": 0,
               "mean_bytes_up_per_client_per_round": 0, "target_accuracy": None, "failures": 0,
               "co_mb_to_target": None}
    print_table(summary, tmp_path)
    out = capsys.readouterr().out
    assert "± se" in out and "acc deployed" in out
    assert "0.750 │ 0.217" in out  # sqrt(0.75 * 0.25 / 4)
    assert "0.875 │ 0.108" in out  # the mean's: sqrt(0.217^2 + 0) / 2
    assert "test images (4..16 here" in " ".join(out.split())  # the note, as rich wraps it
    json.dumps(summary)  # the table does not change the summary it prints
