"""``rafl compare``: smoke run on tiny digits, and every bad input exits 2 with one line, writing nothing."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from rafl.cli import cli

TINY = ["--set", "data.limit_per_class=10", "--set", "clients.n=3", "--set", "partition.scheme=pathological",
        "--set", "partition.k=2", "--set", "partition.public_fraction=0.0", "--set", "engine.rounds=1",
        "--set", "train.threads=1", "--set", "train.batch_size=16",
        "--models", "cnn4-small,cnn3-small", "--feature-dim", "16", "--quiet"]


def test_compare_smoke(tmp_path):
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedgh,fedtgp,standalone", *TINY,
                                   "--set", "algorithm.fedtgp.server_epochs=2",
                                   "--set", "algorithm.fedgh.label_prior=local", "--set", "algorithm.lr=0.02",
                                   "--set", "algorithm.fedtgp.local_epochs=1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    for f in ("compare.md", "compare.csv", "compare.json", "compare.png", "config.yaml"):
        assert (out / f).is_file()
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [r["algorithm"] for r in rows] == ["fedgh", "fedtgp", "standalone"]
    for r in rows:
        assert 0 <= r["model.acc_mean"] <= 1 and r["wall_s"] > 0
        assert 0 <= r["model.acc_pooled"] <= 1
    assert rows[2]["mb_total"] == 0 and rows[0]["mb_up"] > 0
    assert "proto.acc_mean" in rows[1]
    # the same partition for every method
    parts = {(out / a / "clients.json").read_text() for a in ("fedgh", "fedtgp", "standalone")}
    assert len(parts) == 1
    assert "| fedgh |" in res.output
    # the table says which variant each row is: a method's own non-default hyperparameters
    # (lr=0.02 is every method's, so not shown; fedtgp's own local_epochs is)
    assert [r["settings"] for r in rows] == ["label_prior=local", "local_epochs=1, server_epochs=2", ""]
    assert rows[0]["model.acc_mean"] == rows[0]["prior.acc_mean"]  # label_prior: local deploys the prior
    assert 0 <= rows[0]["local.acc_mean"] <= 1 and "local.acc_mean" not in rows[1]  # FedGH's local header
    md = (out / "compare.md").read_text()
    assert "non-default settings" in md and "label_prior=local" in md and "local-header acc" in md
    assert "pooled acc" in md
    # `rafl federate --resume` on this folder points to `rafl compare --resume` (it used to say
    # "never completed a round ... delete it", which would destroy a finished comparison)
    res = CliRunner().invoke(cli, ["federate", "--resume", str(out)])
    assert res.exit_code == 2 and "delete" not in res.output, res.output
    assert f"{out}: --resume: is a rafl compare folder, not a rafl federate run dir; continue it with: rafl " \
           f"compare --resume {out}" in res.output, res.output
    # its config.yaml (the comparison's record) as --config: one line saying what it is, either command
    for command in (["compare", "--out", str(tmp_path / "again")], ["federate", "--out", str(tmp_path / "again")]):
        res = CliRunner().invoke(cli, [*command, "--config", str(out / "config.yaml")])
        assert res.exit_code == 2 and not (tmp_path / "again").exists(), res.output
        assert f"{out / 'config.yaml'}: algorithms: is the record rafl compare keeps in its folder, not a run " \
               f"config; continue that comparison with: rafl compare --resume {out} " in res.output, res.output
    res = CliRunner().invoke(cli, ["compare", "--config", str(out), "--out", str(tmp_path / "again")])
    assert res.exit_code == 2 and f"{out}: is a folder; expected a YAML run config file" in res.output, res.output


def test_compare_row_pools_the_clients_test_samples():
    """``pooled acc`` = all clients' correct / all their test samples (HtFLlib's Averaged Test
    Accuracy), not the mean over clients: a client of 2 test images counts 2/102."""
    from rafl.federation.engine import summarize_eval
    from rafl.reports.compare import summarize_run

    per_client = {0: {"model.correct": 0.0, "model.total": 2.0}, 1: {"model.correct": 90.0, "model.total": 100.0}}
    history = [{**summarize_eval(per_client).as_row(), "bytes_up": 10, "bytes_down": 20}]
    row = summarize_run("fedgh", {}, history, wall_s=1.0)
    assert row["model.acc_mean"] == pytest.approx((0.0 + 0.9) / 2)
    assert row["model.acc_pooled"] == pytest.approx(90 / 102)
    assert row["model.acc_std"] == pytest.approx(0.45)


@pytest.mark.parametrize("args, msg", [
    (["--algorithms", "fedgh,nope"], "--algorithms: unknown algorithm 'nope'"),
    (["--algorithms", "fedgh,fedgh"], "twice"),
    (["--algorithms", "fedgh,FedGH"], "twice"),  # names are case-insensitive
    (["--algorithms", "fedgh", "--set", "algorithm.bogus=1"], "no selected method accepts"),
    (["--algorithms", "fedgh", "--set", "algorithm.fedgh.server_mode=sideways"], "per-lar"),
    (["--algorithms", "fedgh", "--set", "engine.rounds=0"], "engine.rounds"),
    (["--algorithms", "fedgh", "--set", "nosuch.key=1"], "unknown key"),
    (["--algorithms", "fedgh", "--models", "htfe5"], "unknown model"),
    # make_partition's own names (k, n_clients, --clients) restated as the run config's keys
    (["--algorithms", "fedgh", "--set", "partition.scheme=pathological", "--set", "partition.k=11"],
     "partition.k: impossible partition of digits (1797 samples) over clients.n=10 clients: is 11, allowed: an "
     "integer 1..10"),
    (["--algorithms", "fedgh", "--set", "data.limit_per_class=10", "--set", "clients.n=40"],
     "lower clients.n or partition.min_samples"),
    (["--algorithms", "fedgh", "--set", "engine.clients_per_round=1.5"],
     "engine.clients_per_round: neither a fraction nor a whole count (got 1.5)"),
    (["--algorithms", "fedkd", "--set", "algorithm.fedkd.energy_start=1.5"],
     "algorithm.fedkd.energy_start: is 1.5; allowed: a fraction in (0, 1]"),
    (["--algorithms", "fml", "--set", "algorithm.knowledge_arch=bogus"],
     "algorithm.knowledge_arch: is 'bogus', but model-group clients have no supernet"),
    (["--algorithms", "fedgh,fedavg", "--set", "clients.n=3"], "--models: gives the clients 3 different architectures "
                                                               "(cnn3-small, cnn4-small, mobilenet_v2-0.25), but fedavg "
                                                               "averages whole models"),
    (["--algorithms", "fedgh", "--config", "missing.yaml"], "no such file"),
    # a --set for a method that is not compared is a slip, not silently ignored
    (["--algorithms", "fedgh", "--set", "algorithm.fedtgp.server_epochs=5"],
     "--set: algorithm.fedtgp.server_epochs: sets a hyperparameter of fedtgp, which --algorithms does not select"),
    # checked before anything runs (they used to end in a traceback in the first client's training)
    (["--algorithms", "fedgh", "--set", "algorithm.optimizer=rmsprop"],
     "--set: algorithm.optimizer: is 'rmsprop'; allowed: sgd, adam"),  # the shared key, as written
    (["--algorithms", "fedgh,fedtgp", "--set", "algorithm.distance=squared"],
     "--set: algorithm.distance: is 'squared'; allowed: euclidean, mse (for fedtgp)"),  # which method refused it
    (["--algorithms", "fedtgp", "--set", "algorithm.fedtgp.server_hidden_dim=-1"],
     "algorithm.fedtgp.server_hidden_dim: is -1; allowed: an integer >= 0"),
    # more clients per round than clients: an error, not a silent clamp
    (["--algorithms", "fedgh", "--set", "clients.n=4", "--set", "engine.clients_per_round=5"],
     "engine.clients_per_round: is 5, more than the 4 clients (clients.n); allowed: a fraction in (0, 1] or a count in 1..4"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, args, msg):
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", *args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and msg in lines[0], res.output
    assert not out.exists()


def test_nonempty_out_is_refused(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--out", str(out)])
    assert res.exit_code == 2 and "not empty" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    for command in ("compare", "federate"):  # a folder that is not there is said so, not "no config.yaml"
        res = CliRunner().invoke(cli, [command, "--resume", str(tmp_path / "nope")])
        assert res.exit_code == 2 and "nope: --resume: does not exist" in res.output, res.output
        res = CliRunner().invoke(cli, [command, "--resume", str(out)])
        assert res.exit_code == 2 and "(no config.yaml)" in res.output, res.output


@pytest.mark.parametrize("argv, msg", [(["federate", "--nope"], "error: No such option '--nope'"),
                                       (["compare", "--feature-dim", "abc"], "error: Invalid value for '--feature-dim'"),
                                       (["nope"], "error: No such command 'nope'")])
def test_usage_errors_are_one_line_exit_2(argv, msg, capsys):
    from rafl.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.count("\n") == 1 and err.startswith(msg) and "--help" in err, err


def test_version_and_help_exit_0(capsys):
    from rafl.cli import main

    for argv in (["--version"], ["compare", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
    assert "Usage: rafl compare" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_keeps_finished_methods_and_continues_an_interrupted_one(tmp_path, monkeypatch):
    """Interrupt fedtgp in round 2 of 2 (after fedgh finished): --resume keeps fedgh's row, continues
    fedtgp from its round-1 checkpoint, runs standalone, and ends with the same table as an
    uninterrupted comparison. The clients run in this process (engine.workers=1): the Ctrl-C is
    raised inside a client's step, and a forked worker's client counts a crash as a failed client
    (test_workers.py checks a real Ctrl-C with workers)."""
    from rafl.federation.algorithms.fedtgp import FedTGP

    tiny = [*TINY, "--set", "engine.workers=1"]
    args = ["compare", "--algorithms", "fedgh,fedtgp,standalone",
            *["engine.rounds=2" if a == "engine.rounds=1" else a for a in tiny]]
    ref = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "ref")])
    assert ref.exit_code == 0, ref.output

    calls = {"n": 0}
    original = FedTGP.client_update

    def crash_in_round_2(self, state, broadcast, client):
        calls["n"] += 1
        if calls["n"] > 3:                      # 3 clients: the 4th call is round 2
            raise KeyboardInterrupt
        return original(self, state, broadcast, client)

    # Ctrl-C before any method completed a round: no folder, and a line that says so (not click's "Aborted!")
    calls["n"] = -10**9
    monkeypatch.setattr(FedTGP, "client_update", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    early = CliRunner().invoke(cli, ["compare", "--algorithms", "fedtgp", *tiny, "--out", str(tmp_path / "early")])
    assert early.exit_code == 130 and not (tmp_path / "early").exists()
    assert early.stderr.strip() == "interrupted before any method completed a round: nothing was kept", early.stderr
    calls["n"] = 0
    monkeypatch.setattr(FedTGP, "client_update", crash_in_round_2)
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert res.exit_code == 130 and (out / "fedtgp" / "checkpoint.safetensors").is_file()  # 128 + SIGINT
    assert "Aborted!" not in res.stderr  # rafl's line says what happened; not click's as well
    assert f"interrupted: finished methods and complete rounds are kept in {out}; continue with: rafl compare " \
           f"--resume {out}" in res.stderr
    assert not (out / "standalone").exists()
    fedgh_metrics = (out / "fedgh" / "metrics.jsonl").read_text()
    monkeypatch.setattr(FedTGP, "client_update", original)

    bad = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--set", "engine.rounds=3"])
    assert bad.exit_code == 2 and "cannot be combined with --set" in bad.output
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert (out / "fedgh" / "metrics.jsonl").read_text() == fedgh_metrics          # not rerun
    rows = json.loads((out / "compare.json").read_text())["rows"]
    ref_rows = json.loads((tmp_path / "ref" / "compare.json").read_text())["rows"]
    assert [r["algorithm"] for r in rows] == ["fedgh", "fedtgp", "standalone"]
    for r, q in zip(rows, ref_rows):
        for k in ("model.acc_mean", "model.acc_std", "mb_total", "rounds"):
            assert r[k] == q[k], (r["algorithm"], k)
    assert CliRunner().invoke(cli, ["compare", "--resume", str(tmp_path / "nope")]).exit_code == 2
    # fewer rounds than already completed: an error, not 2-round rows under a 1-round config
    import yaml

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["engine"]["rounds"] = 1
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 2 and "engine.rounds: is 1, but fedgh has completed 2 rounds; allowed: an integer >= 2" \
        in res.output, res.output


def test_resume_damaged_or_edited_folders_are_one_line_errors(tmp_path):
    import shutil

    args = ["compare", "--algorithms", "fedgh,standalone", *TINY]
    base = tmp_path / "base"
    assert CliRunner().invoke(cli, [*args, "--out", str(base)]).exit_code == 0

    def resume(edit) -> tuple[int, str]:
        d = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        shutil.copytree(base, d)
        edit(d)
        res = CliRunner().invoke(cli, ["compare", "--resume", str(d), "--quiet"])
        return res.exit_code, res.output

    def set_yaml(key, value):
        def edit(d):
            import yaml
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            node = cfg
            *parents, last = key.split(".")
            for p in parents:
                node = node[p]
            node[last] = value
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        return edit

    def other_split(d):
        path = d / "fedgh" / "clients.json"
        rec = json.loads(path.read_text())
        rec["clients"][0]["n_train"] += 1
        path.write_text(json.dumps(rec))

    cases = [(lambda d: (d / "compare.json").write_text("{"), "not a rafl compare table"),
             (lambda d: (d / "compare.json").write_text("[1, 2]"), "not a rafl compare table"),
             (lambda d: (d / "compare.json").write_text('{"rows": [{"rounds": 2}]}'), "not a rafl compare table"),
             (set_yaml("feature_dim", "abc"), "feature_dim: is 'abc'; allowed: an integer >= 1"),
             (set_yaml("algorithms.fedgh.label_prior", "global"),
              "config.yaml: algorithms.fedgh.label_prior: is 'global'; allowed: none, local"),
             (set_yaml("feature_dim", 32), "differs from the settings"),
             (set_yaml("data.limit_per_class", 12), "differs from the settings"),
             (set_yaml("models", "htfe5"), "config.yaml: models: unknown model"),
             (set_yaml("models", "cnn4-small,no_such_module_qa:make"),
              "config.yaml: models: cannot import 'no_such_module_qa'"),
             (lambda d: (shutil.rmtree(d / "fedgh"), (d / "fedgh").write_text("x")), "is not a folder"),
             # the split the method ran on is not the one the resume would load (a changed partition file)
             (other_split, "fedgh/clients.json: client 0 had other data or another model when the run started "
                           "(n_train ")]
    for edit, msg in cases:
        code, output = resume(edit)
        lines = [ln for ln in output.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and msg in lines[0], (msg, output)
    # a finished comparison whose tables were deleted: resume rebuilds them without rerunning anything
    code, output = resume(lambda d: [(d / f).unlink() for f in ("compare.md", "compare.csv")])
    assert code == 0 and "| fedgh |" in output, output

    # a run started before fedgh had deploy_header: the new option at its default changes nothing
    def started_before_deploy_header(value):
        def edit(d):
            import yaml
            path = d / "fedgh" / "compare_started_with.json"
            started = json.loads(path.read_text())
            del started["hparams"]["deploy_header"]
            path.write_text(json.dumps(started))
            cfg = yaml.safe_load((d / "config.yaml").read_text())
            cfg["algorithms"]["fedgh"].pop("deploy_header")
            if value is not None:
                cfg["algorithms"]["fedgh"]["deploy_header"] = value
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
        return edit

    code, output = resume(started_before_deploy_header(None))
    assert code == 0 and "| fedgh |" in output, output
    code, output = resume(started_before_deploy_header("local"))
    assert code == 2 and "differs from the settings" in output, output


def test_group_without_command_prints_help(capsys):
    from rafl.cli import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("Usage: rafl") and "error:" not in err
    with pytest.raises(SystemExit):
        main(["compare", "--resume"])
    assert "(see 'rafl compare --help')" in capsys.readouterr().err


def test_no_test_share_warns_once_on_stderr(tmp_path):
    """A split without a test share is valid (nothing to evaluate), but the user is told why the
    table has no accuracy columns."""
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--set",
                                   "partition.split=[0.8,0.2,0.0]", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "warning: partition.split is [0.8, 0.2, 0.0]: the test share is 0" in res.stderr
    md = (out / "compare.md").read_text()
    assert "acc mean" not in md and md.startswith("No accuracy: no client holds test data")
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])  # says so again
    assert res.exit_code == 0 and "warning: partition.split is [0.8, 0.2, 0.0]" in res.stderr, res.output


def test_unwritable_out_and_undecodable_config_are_one_line_errors(tmp_path):
    afile = tmp_path / "a.txt"
    afile.write_text("x")
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--out", str(afile / "sub")])
    assert res.exit_code == 2 and f"--out: cannot be created: {afile} is a file" in res.output, res.output
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe\x00a: 1")
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", "--config", str(bad),
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "bad.yaml: not valid YAML (not UTF-8 text" in res.output, res.output
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".rafl-probe-*"))


def test_a_method_failing_in_round_1_leaves_nothing_behind(tmp_path, monkeypatch):
    """A plug-in whose features turn NaN in training: local training stops at the first NaN loss
    (exit 2, the message names the client and its model), and no half-made folder blocks rerunning
    the command."""
    (tmp_path / "nan_plugin_qa.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class N(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.f = nn.Sequential(nn.Flatten(), nn.LazyLinear(16))\n"
        "        self.head = nn.Linear(16, 10)\n"
        "    def features(self, x):\n"
        "        z = self.f(x)\n"
        "        return z * float('nan') if self.training else z\n"
        "    def forward(self, x):\n"
        "        return self.head(self.features(x))\n"
        "def make():\n"
        "    return N()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "cmp"
    args = ["compare", "--algorithms", "fedgh,standalone",
            *[a if a != "cnn4-small,cnn3-small" else "nan_plugin_qa:make" for a in TINY], "--out", str(out)]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 2, res.output
    # which method failed, and its key as compare names it (the method's own section)
    assert "error: fedgh, client 0 (model nan_plugin_qa:make): algorithm.fedgh.lr: local training diverged " \
           "(loss nan)" in res.output
    assert "; nothing was kept: run the command again with --set algorithm.fedgh.lr=<value>" in res.output
    assert not out.exists()

    # Standalone has no upload to validate: it used to finish with the accuracy of NaN weights
    res = CliRunner().invoke(cli, [a if a != "fedgh,standalone" else "standalone" for a in args])
    assert res.exit_code == 2 and "local training diverged" in res.output, res.output
    assert not out.exists()


def test_a_diverged_method_says_how_to_rerun_it_alone(tmp_path):
    """A method diverging after others finished: its keys as compare names them, also inside the
    message, and the way to rerun it with another value (--resume alone would diverge again)."""
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone,fd", *TINY, "--set", "algorithm.fd.lr=1e12",
                                   "--out", str(out)])
    assert res.exit_code == 2, res.output
    line = [ln for ln in res.output.splitlines() if ln.strip()][-1]
    assert line.startswith("error: fd, client ") and ": algorithm.fd.lr: local training diverged" in line, line
    assert "allowed: a smaller value of it or of algorithm.fd.gamma" in line, line
    assert line.endswith(f"; to rerun fd with another value, edit algorithms.fd.lr in {out}/config.yaml, delete "
                         f"{out}/fd/ and run rafl compare --resume {out}"), line
    assert (out / "standalone" / "summary.json").is_file()


def test_after_rerunning_a_diverged_method_the_kept_rows_settings_follow_the_final_config(tmp_path):
    """Following the divergence hint (edit algorithms.fd.lr in config.yaml, delete fd/, --resume):
    the "non-default settings" column of the row kept from the first run (standalone) is computed
    from the final hyperparameters of all methods, as a fresh comparison with that config writes it.
    (The first run showed standalone's lr=0.01: it differed from fd's 1e12; fd's is 0.01 now too.)"""
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone,fd", *TINY, "--set", "algorithm.fd.lr=1e12",
                                   "--out", str(out)])
    assert res.exit_code == 2 and "delete" in res.output, res.output
    assert [r["settings"] for r in json.loads((out / "compare.json").read_text())["rows"]] == ["lr=0.01"]
    started = (out / "standalone" / "compare_started_with.json").read_text()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["algorithms"]["fd"]["lr"] = 0.01
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    import shutil

    shutil.rmtree(out / "fd", ignore_errors=True)  # (gone already: fd failed in round 1)
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    fresh = tmp_path / "fresh"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone,fd", *TINY, "--set", "algorithm.fd.lr=0.01",
                                   "--out", str(fresh)])
    assert res.exit_code == 0, res.output

    def settings(d):
        return [(r["algorithm"], r["settings"]) for r in json.loads((d / "compare.json").read_text())["rows"]]

    def header(d):
        return [ln for ln in (d / "compare.md").read_text().splitlines() if ln.startswith("| method")]

    assert settings(out) == settings(fresh) == [("standalone", ""), ("fd", "")]
    assert header(out) == header(fresh) and "non-default settings" not in header(out)[0]
    assert "lr=0.01" not in (out / "compare.csv").read_text()
    # the kept method's run dir still records what it was started with
    assert (out / "standalone" / "compare_started_with.json").read_text() == started


def test_a_finished_method_whose_run_dir_was_removed_is_rerun_on_resume(tmp_path):
    """Editing a finished method's value makes --resume say "remove the method's run dir to rerun
    it"; doing so reruns that method with the new value (its old row in compare.json used to make
    the next --resume fail on the missing compare_started_with.json). The other row is kept."""
    import shutil

    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone,fd", *TINY, "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    kept = json.loads((out / "compare.json").read_text())["rows"][0]
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["algorithms"]["fd"]["gamma"] = 0.5
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 2 and "remove the method's run dir to rerun it" in res.output, res.output
    shutil.rmtree(out / "fd")
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [r["algorithm"] for r in rows] == ["standalone", "fd"] and rows[0] == kept
    assert json.loads((out / "fd" / "compare_started_with.json").read_text())["hparams"]["gamma"] == 0.5


def test_the_nearest_prototype_legend_covers_no_bar(tmp_path, monkeypatch):
    """compare.png: the nearest-prototype marker's legend lies outside every axes (it used to sit in
    the accuracy axes' lower right, over the last bar when accuracies are high)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rafl.reports.compare import plot_compare

    close, figs = plt.close, []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to measure it
    rows = [{"algorithm": name, "model.acc_mean": 0.9, "model.acc_std": 0.05, "proto.acc_mean": 0.85,
             "mb_total": 1.0 + i, "wall_s": 1.0 + i} for i, name in enumerate(["fedproto", "fedtgp", "standalone"])]
    plot_compare(tmp_path / "compare.png", rows)
    assert (tmp_path / "compare.png").is_file()
    (fig,) = figs
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert len(legends) == 1 and legends[0].get_texts()[0].get_text() == "nearest prototype"
        box = legends[0].get_window_extent(renderer)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)  # not cut off
        for ax in fig.axes:
            assert ax.patches and not any(box.overlaps(bar.get_window_extent(renderer)) for bar in ax.patches)
            assert not box.overlaps(ax.get_tightbbox(renderer))  # nor the axes, tick labels, title
    finally:
        close(fig)

def test_clients_too_small_for_a_test_sample_are_reported(tmp_path):
    """The default split 0.8/0.1/0.1 gives a client of 2-3 samples no test sample; the accuracy mean
    is then over the others, and the user is told."""
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--set", "partition.scheme=iid",
                                   "--set", "clients.n=40", "--set", "partition.min_samples=1",
                                   "--set", "partition.split=[0.8,0.1,0.1]", "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    assert "clients hold no test sample (too small for the test share 0.1); accuracy is the mean over the other" \
        in res.stderr, res.stderr


def test_settings_that_do_nothing_here_are_warned_about(tmp_path):
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--set", "algorithm.name=fedgh",
                                   "--set", "clients.arch=whatever", "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    assert "warning: clients.arch / clients.archs pick supernet subnets" in res.stderr
    assert "warning: algorithm.name is ignored by compare" in res.stderr


def test_errors_name_set_when_a_set_value_is_wrong_and_the_file_otherwise(tmp_path):
    """With --config and --set together, the error names whichever of the two wrote the bad value."""
    good = tmp_path / "good.yaml"
    good.write_text("engine:\n  rounds: 2\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  rounds: abc\nalgorithm:\n  name: fedgh\n  deploy_header: globl\n")
    cases = [(["federate", "--config", str(good), "--set", "algorithm.name=fedgh",
               "--set", "algorithm.deploy_header=globl"], "error: --set: algorithm.deploy_header: is 'globl'"),
             (["federate", "--config", str(good), "--set", "engine.rounds=abc"], "error: --set: engine.rounds:"),
             (["federate", "--config", str(bad), "--set", "engine.rounds=2"],
              f"error: {bad}: algorithm.deploy_header: is 'globl'"),
             (["compare", "--algorithms", "fedgh", "--config", str(good), "--set", "algorithm.deploy_header=globl"],
              "error: --set: algorithm.deploy_header: is 'globl'"),  # a shared key, named as written
             (["compare", "--algorithms", "fedgh", "--config", str(good), "--set", "engine.rounds=abc"],
              "error: --set: engine.rounds:"),
             (["compare", "--algorithms", "fedgh", "--config", str(bad), "--set", "engine.rounds=2"],
              f"error: {bad}: algorithm.deploy_header: is 'globl'")]
    for args, msg in cases:
        res = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, msg", [
    ("algorithm: [1, 2]\n", "algorithm: is [1, 2]; allowed: a mapping of hyperparameters"),
    ("algorithm: 5\n", "algorithm: is 5; allowed: a mapping"),
    # one method, two spellings: which one wins would be a guess
    ("algorithm:\n  FedTGP: {server_epochs: 2}\n  fedtgp: {server_epochs: 3}\n",
     "algorithm: has 2 sections for fedtgp (FedTGP, fedtgp); allowed: one per method"),
])
def test_malformed_algorithm_section_of_a_config_is_one_line_naming_the_file(tmp_path, text, msg):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedtgp", "--config", str(cfg), "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {cfg}: ") and msg in lines[0], res.output
    assert not out.exists()


def test_set_into_a_config_key_that_is_not_a_section(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm:\n  fedtgp: 5\n")
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedtgp", "--config", str(cfg), "--set",
                                   "algorithm.fedtgp.server_epochs=2", "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 2
    assert f"error: --set: algorithm.fedtgp: is not a section in {cfg} (it is 5)" in res.output


def test_empty_method_section_in_a_config_takes_set_values_and_unused_weights_are_warned(tmp_path):
    """``fedtgp:`` with nothing under it (YAML null) is an empty section; a FedTGP weight that the
    chosen distance does not use is accepted with a warning."""
    from rafl.stages.compare import load_compare_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm:\n  fedtgp:\n")
    _, hps = load_compare_config(cfg, ["algorithm.fedtgp.server_epochs=2"], ["fedtgp"])
    assert hps["fedtgp"]["server_epochs"] == 2
    # a shared --set wins over the file's section (the command line is the later word)
    cfg.write_text("algorithm:\n  fedtgp: {tau: 5}\n")
    assert load_compare_config(cfg, ["algorithm.tau=9"], ["fedtgp"])[1]["fedtgp"]["tau"] == 9
    assert load_compare_config(cfg, [], ["fedtgp"])[1]["fedtgp"]["tau"] == 5
    cfg.write_text("algorithm:\n  fedtgp:\n")
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedtgp", *TINY,
                                   "--set", "algorithm.fedtgp.server_epochs=2", "--set", "algorithm.fedtgp.lambda_mse=3",
                                   "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 0, res.output
    assert "warning: fedtgp: lambda_mse has no effect with distance: euclidean (its weight is lambda)" in res.stderr


def test_fedtgp_at_its_defaults_warns_about_no_weight(capsys):
    """The resolved hyperparameters hold both weights at their defaults: no reason to warn (every
    default FedTGP run used to warn about lambda_mse); a changed unused weight still warns."""
    from rafl.errors import reset_warnings
    from rafl.federation.algorithms.fedtgp import FedTGP

    reset_warnings()
    FedTGP.check_hparams(FedTGP.check_hparams({}))
    FedTGP.check_hparams(FedTGP.check_hparams({"distance": "mse"}))
    assert capsys.readouterr().err == ""
    FedTGP.check_hparams({"distance": "mse", "lambda": 0.5})
    assert "warning: fedtgp: lambda has no effect with distance: mse (its weight is lambda_mse)" in capsys.readouterr().err


def test_resume_after_the_user_model_changed_is_one_line_error(tmp_path, monkeypatch):
    """A user's model whose layers changed between a comparison and its --resume: the stored client
    states no longer fit. One line naming the client and model (it was a load_state_dict
    traceback); the completed round stays."""
    import yaml

    (tmp_path / "qa_resume_plug.py").write_text(
        "import os\nfrom torch import nn\n"
        "class N(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        extra = [nn.Linear(16, 16)] if os.environ.get('QA_PLUG_WIDER') else []\n"
        "        self.f = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 16), *extra)\n"
        "        self.head = nn.Linear(16, 10)\n"
        "    def features(self, x):\n"
        "        return self.f(x)\n"
        "    def forward(self, x):\n"
        "        return self.head(self.features(x))\n"
        "def make():\n"
        "    return N()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("QA_PLUG_WIDER", raising=False)
    out = tmp_path / "cmp"
    args = ["compare", "--algorithms", "fedproto",
            *[a if a != "cnn4-small,cnn3-small" else "qa_resume_plug:make" for a in TINY], "--out", str(out)]
    assert CliRunner().invoke(cli, args).exit_code == 0
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["engine"]["rounds"] = 2
    (out / "config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("QA_PLUG_WIDER", "1")
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: fedproto, client 0 (model qa_resume_plug:make): its stored state "
                                                   "does not fit the model built now"), res.output
    assert len((out / "fedproto" / "metrics.jsonl").read_text().splitlines()) == 1


def test_compare_takes_the_model_group_from_the_config_unless_models_is_given(tmp_path):
    """`clients.models` / `clients.feature_dim` in the run config (the keys rafl federate uses) pick
    compare's model group too; --models / --feature-dim on the command line win. The record
    (config.yaml) says which models ran."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("clients: {models: cnn3-small, feature_dim: 8}\n")
    base = [a for a in TINY if a not in ("--models", "cnn4-small,cnn3-small", "--feature-dim", "16")]
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", "--config", str(cfg), *base,
                                   "--out", str(tmp_path / "a")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "a" / "compare.json").read_text())["models"] == "cnn3-small"
    ran = yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["clients"]
    assert (ran["models"], ran["feature_dim"]) == ("cnn3-small", 8)
    clients = json.loads((tmp_path / "a" / "standalone" / "clients.json").read_text())
    assert {c["model"] for c in clients["clients"]} == {"cnn3-small"}
    assert (clients["models"], clients["feature_dim"]) == ("cnn3-small", 8)
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", "--config", str(cfg), *base,
                                   "--models", "cnn4-small", "--out", str(tmp_path / "b")])
    assert res.exit_code == 0, res.output
    record = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    assert (record["models"], record["clients"]["models"], record["feature_dim"]) == ("cnn4-small", "cnn4-small", 8)
    bad = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", "--config", str(cfg), *base,
                                   "--set", "clients.models=htfe9", "--out", str(tmp_path / "c")])
    assert bad.exit_code == 2 and "clients.models: unknown model 'htfe9'" in bad.output, bad.output
    assert not (tmp_path / "c").exists()


def test_a_second_run_into_the_same_out_stops_at_the_claim(tmp_path, monkeypatch):
    """Two comparisons (or supernet trainings) started together into one --out both passed the
    emptiness check and wrote into the same folder (config.yaml of one, runs of both). The first to
    write its record claims the folder (O_EXCL); the other stops with one line and writes nothing."""
    from rafl.errors import UserInputError
    from rafl.io import claim_file

    claim_file(tmp_path / "a" / "config.yaml")
    with pytest.raises(UserInputError, match=r"a: --out: another run is writing into this folder \(config.yaml "
                                             r"appeared a moment ago\)"):
        claim_file(tmp_path / "a" / "config.yaml")
    # the race itself: the other run claims the folder after this one found it empty
    import rafl.stages.compare.methods as cmp

    out = tmp_path / "cmp"
    real = cmp.participation

    def other_run_claims(*args, **kwargs):
        claim_file(out / "config.yaml")
        return real(*args, **kwargs)

    monkeypatch.setattr(cmp, "participation", other_run_claims)
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--out", str(out)])
    assert res.exit_code == 2 and "another run is writing into this folder" in res.output, res.output
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml"] and (out / "config.yaml").read_text() == ""


def test_table_never_shows_zero_mb_for_a_method_that_communicated(tmp_path):
    """The MB columns keep 3 decimals, but a few hundred bytes (prototype uploads) read 0.000 MB."""
    from rafl.reports.compare import write_table

    rows = [{"algorithm": "fedproto", "mb_up": 0.00044, "mb_down": 0.000044, "mb_total": 0.000484},
            {"algorithm": "fedavg", "mb_up": 1.25, "mb_down": 1.25, "mb_total": 2.5},
            {"algorithm": "standalone", "mb_up": 0.0, "mb_down": 0.0, "mb_total": 0.0}]
    write_table(tmp_path, rows, "subnets")
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in (tmp_path / "compare.md").read_text().splitlines() if line.startswith("| ")}
    assert table["fedproto"] == ["0.00044", "0.000044", "0.00048"]
    assert table["fedavg"] == ["1.250", "1.250", "2.500"] and table["standalone"] == ["0.000"] * 3


def test_data_root_option_is_short_for_set_data_root(tmp_path):
    missing = tmp_path / "no-such-cifar"
    for cmd in (["compare", "--algorithms", "standalone", *TINY, "--out", str(tmp_path / "c")],
                ["federate", "--no-progress", "--out", str(tmp_path / "f")]):
        res = CliRunner().invoke(cli, [*cmd, "--data-root", str(missing), "--set", "data.dataset=cifar10"])
        assert res.exit_code == 2 and str(missing) in res.output, res.output
        assert not (tmp_path / "c").exists() and not (tmp_path / "f").exists()
    shown = CliRunner().invoke(cli, ["federate", "--data-root", str(missing), "--show-config"])
    assert shown.exit_code == 0 and f"root: {missing}" in shown.output
    both = CliRunner().invoke(cli, ["compare", "--resume", str(tmp_path), "--data-root", str(missing)])
    assert both.exit_code == 2 and "--data-root" in both.output


def test_compare_with_failed_rounds_exits_non_zero_naming_the_method(tmp_path):
    """Every upload over an upload limit far below a model's size: every round of fedgh fails (no
    state changes), standalone (no uploads) is clean; the table says so and the exit status is 3."""
    from rafl.cli.federate import FAILED_ROUNDS_EXIT

    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedgh,standalone", *TINY,
                                   "--set", "engine.max_upload_mb=0.0001", "--out", str(out)])
    assert res.exit_code == FAILED_ROUNDS_EXIT, res.output
    assert "error: fedgh: 1 of 1 round(s) failed; round 1 failed" in res.output
    assert "error: standalone" not in res.output
    rows = {r["algorithm"]: r for r in json.loads((out / "compare.json").read_text())["rows"]}
    assert rows["fedgh"]["failed_rounds"] == 1 and "failed_rounds" not in rows["standalone"]
    assert "- fedgh: 1 of 1 round(s) failed" in (out / "compare.md").read_text()


def test_a_compare_folder_a_live_compare_writes_into_is_refused(tmp_path):
    """rafl compare holds rafl.io.lock_dir on its --out while it runs (here: this process holds it):
    --resume of it is refused with one line; released, the same --resume keeps the finished rows."""
    import os

    from rafl.io import lock_dir

    out = tmp_path / "cmp"
    assert CliRunner().invoke(cli, ["compare", "--algorithms", "standalone", *TINY, "--out", str(out)]).exit_code == 0
    table = (out / "compare.json").read_text()
    fd = lock_dir(out)
    try:
        res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    finally:
        os.close(fd)
    assert res.exit_code == 2 and f"{out}: --resume: another run is writing into this folder now" in res.output, \
        res.output
    assert (out / "compare.json").read_text() == table
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output


def test_a_shared_key_only_unselected_methods_have_is_theirs_in_a_file_and_a_slip_in_set(tmp_path):
    """The headline config's shared ``local_epochs`` with ``--algorithms pretrained`` (the floor has
    no hyperparameters): the file's key belongs to the methods not compared, as their sections do;
    the same key from --set, or a key no method has, is an error."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm:\n  local_epochs: 1\n")
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "pretrained", "--config", str(cfg), *TINY,
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert [r["algorithm"] for r in json.loads((out / "compare.json").read_text())["rows"]] == ["pretrained"]
    for args in ([], ["--set", "algorithm.local_epochs=2"]):
        bad = tmp_path / "bad.yaml"
        bad.write_text("algorithm:\n  local_epochz: 1\n" if not args else "engine:\n  rounds: 1\n")
        res = CliRunner().invoke(cli, ["compare", "--algorithms", "pretrained", "--config", str(bad), *TINY, *args,
                                       "--out", str(tmp_path / "no")])
        assert res.exit_code == 2 and "no selected method accepts" in res.output, res.output
        assert not (tmp_path / "no").exists()


def test_resume_keeps_no_finetune(tmp_path):
    """--no-finetune is recorded in the comparison's config.yaml: --resume makes no -ft rows either; a record
    written before it held the key makes them (as the comparison did then); a bad value is one line."""
    tiny = [a if a != "cnn4-small,cnn3-small" else "cnn4-small" for a in TINY]
    out = tmp_path / "cmp"
    res = CliRunner().invoke(cli, ["compare", "--algorithms", "fedavg", *tiny, "--no-finetune", "--out", str(out)])
    assert res.exit_code == 0, res.output
    record = yaml.safe_load((out / "config.yaml").read_text())
    assert record["finetune"] is False
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert [r["algorithm"] for r in json.loads((out / "compare.json").read_text())["rows"]] == ["fedavg"]
    (out / "config.yaml").write_text(yaml.safe_dump({**record, "finetune": "no"}))
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 2 and "config.yaml: finetune: is 'no'; allowed: true or false" in res.output, res.output
    del record["finetune"]
    (out / "config.yaml").write_text(yaml.safe_dump(record))
    res = CliRunner().invoke(cli, ["compare", "--resume", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    assert [r["algorithm"] for r in json.loads((out / "compare.json").read_text())["rows"]] == ["fedavg", "fedavg-ft"]
