"""``rafl federate``: bad input exits 2 with one line and no run dir; a tiny end-to-end run + resume."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from rafl.cli import cli
from rafl.supernet import build_supernet, save_supernet


def _invoke(args):
    return CliRunner().invoke(cli, ["federate", "--no-progress", *args])


def _one_error_line(result):
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize("args, expected", [
    (["--set", "algorithm.name=fedbogus"], "unknown algorithm 'fedbogus'"),
    (["--set", "engine.roundz=2"], "engine.roundz: unknown key; allowed: rounds"),
    (["--set", "algorithm.tempreature=2"], "unknown hyperparameter(s) ['tempreature']"),
    (["--set", "clients.n=5000"], "impossible partition"),  # more clients than samples
    (["--set", "clients.profiles=[pi5]"], "error: clients.profiles: unknown device profile 'pi5'; shipped"),
    (["--set", "clients.n=3", "--set", "algorithm.name=fedavg", "--set", "clients.arch=r32_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"],
     "error: clients.arch: resolution r: is 32, allowed: one of 16"),
    (["--set", "partition.public_fraction=0.2", "--set", "clients.n=3"], "overlap the supernet's training data"),
    (["--set", "name=../escape"], "name: is '../escape'; allowed: a plain folder name"),
    (["--set", "algorithm.lr=abc"], "algorithm.lr: is 'abc'; allowed: a number"),
    pytest.param(["--set", "algorithm.knowledge_arch=huge", "--set", "clients.n=3"], "algorithm.knowledge_arch",
                 marks=pytest.mark.slow),  # the supernet's space decides it: the run is prepared first
    # YAML reads yes/on as True; pydantic's lax mode would take it as 1 client / 1 round
    (["--set", "clients.n=yes"], "clients.n: a boolean is not allowed here (got True (YAML reads yes/no"),
    (["--set", "engine.rounds=on"], "engine.rounds: a boolean is not allowed here"),
    (["--set", "partition.split=[yes,0,0]"], "partition.split: a boolean is not allowed here (in the list)"),
    (["--set", "train.device=gpu"], "train.device: not a torch device (got 'gpu'); allowed: cpu, cuda or cuda:N"),
    (["--set", "train.device=cuda:99"], "train.device: "),  # no CUDA here, or not 100 devices
    (["--set", "partition.split=[0.5,0.6,-0.1]"], "partition.split: not a valid split (got [0.5, 0.6, -0.1]); "
                                                  "allowed: three fractions train > 0"),
    (["--set", "engine=5"], "error: --set: engine: is 5; allowed: a mapping of the section's keys (rounds, "),
    # a fixed arch for a profile no client uses is a typo (it used to be ignored: the client got a search)
    (["--set", "clients.n=3", "--set", "clients.archs={jetson_nano: r16_x}"],
     "error: clients.archs: names profile(s) ['jetson_nano'] that no client uses"),
    # more clients per round than clients: an error, not a silent clamp to clients.n (before torch: test_checks.py)
    (["--set", "clients.n=3", "--set", "engine.clients_per_round=5"],
     "error: --set: engine.clients_per_round: is 5, more than the 3 clients (clients.n); allowed: a fraction in (0, 1] "
     "or a count in 1..3"),
    (["--set", "clients.n=4", "--set", "engine.available=2", "--set", "engine.clients_per_round=3"],
     "error: --set: engine.clients_per_round: is 3, more than the 2 available clients"),
    # a negative seed was a bare ValueError from numpy in round 1; a huge one overflowed torch's generator
    (["--set", "seed=-1"], "error: --set: seed: Input should be greater than or equal to 0 (got -1); allowed: an "
                           "integer in 0..4294967295"),
    (["--set", "partition.seed=99999999999999"], "partition.seed: Input should be less than or equal to 4294967295"),
    # a missing setting, not an impossible split (the message read "... clients: is required for ...")
    (["--set", "partition.scheme=pathological"], "error: partition.k: is required for partition.scheme pathological"),
    # a union field named as the key (it was engine.clients_per_round.float, without the allowed values)
    (["--set", "engine.clients_per_round=abc"], "error: --set: engine.clients_per_round: Input should be a valid "
                                                "number, unable to parse string as a number (got 'abc'); allowed: a "
                                                "fraction in (0, 1] or a count >= 1"),
])
def test_bad_input_exits_2_without_run_dir(tmp_path, tiny_supernet, args, expected):
    path, _ = tiny_supernet
    out = tmp_path / "runs"
    line = _one_error_line(_invoke(["--out", str(out), "--set", f"supernet.path={path}",
                                    "--set", "data.limit_per_class=10", *args]))
    assert expected in line
    assert not out.exists()  # not even an empty --out folder is left behind


def test_profile_no_subnet_fits_exits_2(tmp_path, tiny_supernet):
    path, _ = tiny_supernet
    prof = yaml.safe_load(open("profiles/pi4.yaml"))
    prof["name"] = "tiny-mcu"
    prof["budgets"] = {"macs_m": 0.001}
    pfile = tmp_path / "tiny-mcu.yaml"
    pfile.write_text(yaml.safe_dump(prof))
    out = tmp_path / "runs"
    line = _one_error_line(_invoke(["--out", str(out), "--set", f"supernet.path={path}", "--set",
                                    "data.limit_per_class=10", "--set", "clients.n=3", "--set",
                                    f"clients.profiles=[{pfile}]"]))
    assert "tiny-mcu" in line and "macs_m" in line
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_tiny_run_then_resume(tmp_path, tiny_supernet):
    path, space = tiny_supernet
    cfg = {
        "name": "tiny",
        "data": {"limit_per_class": 10},
        "partition": {"alpha": 1.0, "min_samples": 5},
        "clients": {"n": 3, "profiles": ["pi4", "phone"], "arch": space.smallest().to_string()},
        "supernet": {"path": str(path)},
        "algorithm": {"name": "rafl", "local_epochs": 1},
        "engine": {"rounds": 1, "target_accuracy": None},
        "train": {"batch_size": 16},
    }
    cfile = tmp_path / "run.yaml"
    cfile.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "runs"
    res = _invoke(["--config", str(cfile), "--out", str(out)])
    assert res.exit_code == 0, res.output
    run_dir = out / "tiny"
    assert f"run dir: {run_dir}" in res.output and "acc knowledge" in res.output and "pi4" in res.output
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["engine"]["rounds"] == 1 and saved["algorithm"]["temperature"] == 1.0  # resolved defaults
    clients = json.loads((run_dir / "clients.json").read_text())["clients"]
    assert [c["profile"] for c in clients] == ["pi4", "phone", "pi4"]
    # the table's MACs are the cost model's conv + linear count, the quantity the budgets limit
    from rafl.search.cost import CostModel

    assert clients[0]["macs_m"] == pytest.approx(CostModel(space).cost(space.smallest()).macs_m, rel=1e-9)
    # same name again: refused, nothing overwritten
    assert "already exists" in _one_error_line(_invoke(["--config", str(cfile), "--out", str(out)]))
    (out / "other").mkdir()
    (out / "other" / "x").write_text("not a run")
    assert "other: name: already exists and is not a rafl federate run dir" in _one_error_line(
        _invoke(["--config", str(cfile), "--out", str(out), "--set", "name=other"]))
    res = _invoke(["--resume", str(run_dir), "--set", "engine.rounds=2"])
    assert res.exit_code == 0, res.output
    rounds = [json.loads(ln)["round"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    assert "error: --set: --resume may change only engine settings (engine.rounds to extend the run, engine.backend, " \
           "...), not ['algorithm.temperature']" in _one_error_line(
        _invoke(["--resume", str(run_dir), "--set", "algorithm.temperature=3.0"]))
    # another method: the same refusal (it used to report the run's hyperparameters as unknown to it)
    assert "not ['algorithm.name', 'clients.models']" in _one_error_line(_invoke(
        ["--resume", str(run_dir), "--set", "algorithm.name=fedgh", "--set", "clients.models=htfe-tiny"]))
    # an invalid --set value is blamed on --set, not on the run's (valid) config.yaml
    line = _one_error_line(_invoke(["--resume", str(run_dir), "--set", "engine.eval_every=0"]))
    assert line.startswith("error: --set: engine.eval_every") and "config.yaml" not in line, line
    assert "--out: cannot be combined with --resume" in _one_error_line(
        _invoke(["--resume", str(run_dir), "--out", str(tmp_path / "elsewhere"), "--set", "engine.rounds=3"]))
    assert "completed 2 rounds; allowed: an integer >= 2" in _one_error_line(
        _invoke(["--resume", str(run_dir), "--set", "engine.rounds=1"]))
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["rounds"] == 2


def test_nan_weights_in_a_checkpoint_are_rejected(tmp_path, tiny_supernet):
    from safetensors.torch import load_file, save_file

    from rafl.errors import UserInputError
    from rafl.supernet import load_supernet

    path, space = tiny_supernet
    weights = next(path.glob("*.safetensors"))
    state = load_file(str(weights))
    key = next(k for k, v in state.items() if v.is_floating_point())
    state[key][0] = float("nan")
    bad = tmp_path / "bad.safetensors"
    save_file(state, str(bad))
    with pytest.raises(UserInputError, match="NaN or Inf"):
        load_supernet(bad, space)


@pytest.mark.integration
def test_sigterm_unwinds_like_ctrl_c(tmp_path, tiny_supernet):
    """A batch scheduler's SIGTERM before round 1 completes leaves no run dir (it used to leave one
    that could be neither resumed nor rerun); after a completed round the checkpoint stays and
    --resume continues."""
    import os
    import signal
    import subprocess
    import sys
    import time

    path, _ = tiny_supernet
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "rafl", "federate", "--no-progress", "--out", str(out), "--set", "name=r",
           "--set", f"supernet.path={path}", "--set", "data.limit_per_class=10", "--set", "clients.n=3",
           "--set", "engine.rounds=200", "--set", "algorithm.name=standalone"]
    for wait_for in ("config.yaml", "checkpoint.safetensors"):
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not (out / "r" / wait_for).exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, err
        if wait_for == "config.yaml":
            assert not (out / "r").exists(), list(out.rglob("*")) if out.exists() else None
            assert err.rstrip().endswith("interrupted before the first complete round: nothing was kept"), err
        else:
            assert (out / "r" / "checkpoint.safetensors").is_file()
            done = len((out / "r" / "metrics.jsonl").read_text().splitlines())
            assert f"interrupted: {done} complete round(s) checkpointed in {out / 'r'}; continue with: rafl " \
                   f"federate --resume {out / 'r'}" in err, err
            res = _invoke(["--resume", str(out / "r"), "--set", f"engine.rounds={done + 1}"])
            assert res.exit_code == 0, res.output
    # Ctrl-C (SIGINT) unwinds the same way and exits 130 (128 + SIGINT), the shell's convention, also
    # for a run started with SIGINT ignored, as a shell starts a background job (`rafl federate ... &`)
    proc = subprocess.Popen([*cmd[:8], "name=s", *cmd[9:]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.time() + 120
    while not (out / "s" / "config.yaml").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert not (out / "s").exists()
    assert err.rstrip().endswith("interrupted before the first complete round: nothing was kept"), err


@pytest.mark.parametrize("trained_on, run_sets, field", [
    ({"dataset": "digits", "limit_per_class": 150}, [], "data.limit_per_class"),
    ({"dataset": "cifar10", "limit_per_class": 10}, [], "data.dataset"),
])
def test_supernet_trained_on_another_sample_of_the_data_is_refused(tmp_path, tiny_supernet, trained_on, run_sets,
                                                                   field):
    """The public pool is carved from the dataset's labels: the same (fraction, seed) on another
    sample (dataset, limit_per_class) is another pool, and client data would hold supernet images."""
    _, space = tiny_supernet
    d = tmp_path / "sn"
    save_supernet(d, build_supernet(space).eval(),
                  config={"public_fraction": 0.3, "public_seed": 0, **trained_on}, metrics={})
    out = tmp_path / "runs"
    line = _one_error_line(_invoke(["--out", str(out), "--set", f"supernet.path={d}",
                                    "--set", "data.limit_per_class=10", "--set", "clients.n=3", *run_sets]))
    assert f"error: {field}: the supernet in {d} trained on" in line and "overlap the supernet's training data" in line
    assert not out.exists()


def test_a_malformed_profile_file_names_the_file_and_its_field(tmp_path, tiny_supernet):
    path, _ = tiny_supernet
    prof = yaml.safe_load(open("profiles/pi4.yaml"))
    prof.pop("throughput_gmacs")
    pfile = tmp_path / "b3.yaml"
    pfile.write_text(yaml.safe_dump(prof))
    line = _one_error_line(_invoke(["--out", str(tmp_path / "runs"), "--set", f"supernet.path={path}", "--set",
                                    "data.limit_per_class=10", "--set", "clients.n=3", "--set",
                                    f"clients.profiles=[{pfile}]"]))
    assert line.startswith(f"error: {pfile}: throughput_gmacs: missing required field; allowed: a finite number > 0")


def test_the_quickstart_supernet_refuses_a_sample_of_digits(tmp_path):
    """The quickstart supernet trained on all of digits: data.limit_per_class would carve another
    public pool, so client data would hold its training images (checked before it is trained)."""
    out = tmp_path / "runs"
    line = _one_error_line(_invoke(["--out", str(out), "--set", "data.limit_per_class=30", "--set", "clients.n=3"]))
    assert line.startswith("error: data.limit_per_class: the quickstart supernet trained on limit_per_class=null, "
                           "the run loads data.limit_per_class=30")
    assert not out.exists()


def test_a_given_arch_over_a_device_budget_runs_with_a_warning(tmp_path, tiny_supernet):
    """``clients.arch`` / ``clients.archs`` are the user's choice (e.g. one model for every device):
    a subnet over a profile's budget runs, but stderr and clients.json say which budget it breaks."""
    path, space = tiny_supernet
    out = tmp_path / "runs"
    res = _invoke(["--out", str(out), "--set", "name=r", "--set", f"supernet.path={path}",
                   "--set", "data.limit_per_class=10", "--set", "clients.n=2", "--set", "clients.profiles=[pi4]",
                   "--set", "clients.budgets={pi4: {macs_m: 0.01}}", "--set", "algorithm.name=standalone",
                   "--set", "engine.rounds=1", "--set", f"clients.archs={{pi4: '{space.smallest().to_string()}'}}"])
    assert res.exit_code == 0, res.output
    assert "warning: clients.archs.pi4 does not fit device profile 'pi4' (macs_m: " in res.output
    clients = json.loads((out / "r" / "clients.json").read_text())["clients"]
    assert all(c["subnet_source"].startswith("given (over budget: macs_m: ") for c in clients), clients


def test_an_unreachable_budget_set_in_the_run_config_is_blamed_on_its_key(tmp_path, tiny_supernet):
    """A budget that ``clients.budgets`` (or ``--set``) overrode and no subnet reaches names that
    key, not the profile's own budgets (``pi4.budgets``, which the user never wrote); a budget
    of the profile file itself keeps naming the profile. Exit 2, no run dir."""
    from rafl.search.profile import load_profile

    path, _ = tiny_supernet
    out = tmp_path / "runs"
    res = _invoke(["--out", str(out), "--set", "name=r", "--set", f"supernet.path={path}",
                   "--set", "data.limit_per_class=10", "--set", "clients.n=2", "--set", "clients.profiles=[pi4]",
                   "--set", "clients.budgets.pi4.macs_m=0.0001", "--set", "engine.rounds=1"])
    assert res.exit_code == 2, res.output
    assert "error: clients.budgets.pi4.macs_m: no subnet of the search space meets the budgets: macs_m <= " \
        in res.output, res.output
    assert not (out / "r").exists()
    pi4 = load_profile("pi4")
    tight = pi4.with_budgets({"macs_m": 0.0001}, source="clients.budgets.pi4")
    assert tight.budget_field("macs_m") == "clients.budgets.pi4.macs_m" and tight.budget_field("latency_ms") is None
    assert pi4.budget_field("macs_m") is None


def test_fedtgp_prints_head_and_nearest_prototype_accuracy(tmp_path, tiny_supernet):
    """Issue 7: FedTGP reports both head and nearest-prototype accuracy; `rafl federate` prints
    both per client, their means, and each one's mean / sample-weighted / std line (it printed
    the head's only; the prototype accuracy was in summary.json alone)."""
    path, space = tiny_supernet
    out = tmp_path / "runs"
    res = _invoke(["--out", str(out), "--set", "name=r", "--set", f"supernet.path={path}",
                   "--set", "data.limit_per_class=10", "--set", "clients.n=2", "--set", "algorithm.name=fedtgp",
                   "--set", "algorithm.server_epochs=2", "--set", "engine.rounds=2",
                   "--set", f"clients.arch={space.smallest().to_string()}"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "r" / "summary.json").read_text())
    mean = summary["means"]["proto.acc"]
    assert mean == pytest.approx(sum(r["proto.acc"] for r in summary["table"]) / 2)
    assert "acc nearest prototype" in res.output and "warning" not in res.output
    assert f"nearest-prototype accuracy: mean over clients {summary['final']['proto.acc_mean_over_clients']:.3f}" \
        in res.output
    mean_row = next(line for line in res.output.splitlines() if "mean" in line and "│" in line)
    assert f"{summary['means']['model.acc']:.3f}" in mean_row and f"{mean:.3f}" in mean_row


def test_a_model_group_federates_resumes_and_rejects_bad_members(tmp_path, monkeypatch):
    """Issue 7: `clients.models` gives rafl federate a heterogeneous model group (no supernet,
    profile or search), plug-ins included; the run resumes like any other, and a bad group or a
    whole-model method over different architectures is one line, exit 2, nothing written."""
    (tmp_path / "tiny_user_model.py").write_text(
        "from torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, n_classes, feature_dim):\n"
        "        super().__init__()\n"
        "        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),\n"
        "                                      nn.Flatten(), nn.Linear(8, feature_dim))\n"
        "        self.head = nn.Linear(feature_dim, n_classes)\n"
        "def factory(n_classes, feature_dim):\n"
        "    return Net(n_classes, feature_dim)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "runs"
    sets = ["--set", "data.limit_per_class=20", "--set", "clients.n=3", "--set", "algorithm.name=fedtgp",
            "--set", "algorithm.local_epochs=1", "--set", "clients.feature_dim=16",
            "--set", "clients.models=cnn4-small,tiny_user_model:factory"]
    res = _invoke(["--out", str(out), "--set", "name=g", *sets, "--set", "engine.rounds=1",
                   "--set", "algorithm.server_epochs=2"])
    assert res.exit_code == 0, res.output
    clients = json.loads((out / "g" / "clients.json").read_text())
    assert [c["model"] for c in clients["clients"]] == ["cnn4-small", "tiny_user_model:factory", "cnn4-small"]
    assert clients["models"] == "cnn4-small,tiny_user_model:factory" and clients["feature_dim"] == 16
    assert "tiny_user_model:factory" in res.output and "acc nearest prototype" in res.output
    assert "subnets:" not in res.output and "warning" not in res.output
    up = json.loads((out / "g" / "metrics.jsonl").read_text().splitlines()[0])["bytes_up"]
    assert up > 0
    res = _invoke(["--resume", str(out / "g"), "--set", "engine.rounds=2"])
    assert res.exit_code == 0, res.output
    assert [json.loads(r)["round"] for r in (out / "g" / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    bad = {"clients.models=htfe9": "error: clients.models: unknown model 'htfe9'; did you mean 'htfe8'? allowed: nas, "
                                   "a group (htfe4",
           "clients.models=cnn4-small,,tiny_user_model:factory": "error: clients.models: item 2 of "
                                                                "'cnn4-small,,tiny_user_model:factory' is empty",
           # YAML would read this as a mapping: it reaches the field as text, which says what is missing
           "clients.models=tiny_user_model:": "error: clients.models: 'tiny_user_model:' is not "
                                              "package.module:factory",
           "clients.models=nas,cnn4": "error: clients.models: nas cannot be mixed with other models",
           "clients.models=tiny_user_model:nothing": "error: clients.models: ",
           "algorithm.name=fedavg": "error: clients.models: gives the clients 2 different architectures (cnn4-small, "
                                    "tiny_user_model:factory), but fedavg averages whole models"}
    for setting, msg in bad.items():
        res = _invoke(["--out", str(tmp_path / "bad"), "--set", "name=b", *sets, "--set", setting])
        assert res.exit_code == 2 and msg in res.output, (setting, res.output)
        assert len(res.output.strip().splitlines()) == 1, res.output
        assert not (tmp_path / "bad").exists()
    # subnet settings do nothing for a model group: said once, the run goes on
    res = _invoke(["--out", str(out), "--set", "name=w", *sets, "--set", "engine.rounds=1",
                   "--set", "clients.arch=r16_k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3|k3e3.k3e3"])
    assert res.exit_code == 0 and "warning: clients.arch applies to clients.models: nas (supernet subnets) only; " \
        "ignored with clients.models: cnn4-small,tiny_user_model:factory" in res.output, res.output


def test_a_relative_partition_file_is_recorded_absolute_and_a_changed_one_stops_the_resume(tmp_path, monkeypatch):
    """A relative `file:` partition (or supernet.path, data.root) is made absolute in the run's
    config.yaml, so `--resume` from another folder continues on the same split; a YAML's relative
    paths are taken against its folder. A split that changed since the start (the file edited, or
    another one) stops the resume with one line naming clients.json, instead of continuing the run
    on other data."""
    from rafl.data import load_dataset, make_partition

    labels = load_dataset("digits", limit_per_class=10).labels.numpy()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    make_partition(labels, "pathological", 3, 0, k=2, public_fraction=0.0).save(a / "split.json")
    make_partition(labels, "iid", 3, 0, public_fraction=0.0).save(b / "split.json")
    sets = ["--set", "data.limit_per_class=10", "--set", "clients.n=3", "--set", "algorithm.name=fedgh",
            "--set", "clients.models=cnn4-small", "--set", "clients.feature_dim=8", "--set", "name=x"]
    monkeypatch.chdir(a)
    res = _invoke(["--quiet", "--out", str(tmp_path / "runs"), *sets, "--set", "partition.scheme=file:split.json",
                   "--set", "engine.rounds=1"])
    assert res.exit_code == 0, res.output
    run_dir = tmp_path / "runs" / "x"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["partition"]["scheme"] == f"file:{a / 'split.json'}"
    monkeypatch.chdir(b)  # b holds another split.json: the run keeps a's
    res = _invoke(["--quiet", "--resume", str(run_dir), "--set", "engine.rounds=2"])
    assert res.exit_code == 0, res.output
    (a / "split.json").write_text((b / "split.json").read_text())  # the recorded file itself changed
    line = _one_error_line(_invoke(["--resume", str(run_dir), "--set", "engine.rounds=3"]))
    assert line.startswith(f"error: {run_dir / 'clients.json'}: client 0 had other data or another model when the "
                           "run started (n_train ")
    assert "the data or the partition changed (file:" in line
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2  # no round ran on the other split
    # a YAML's relative paths: against its own folder, not the current one
    (b / "run.yaml").write_text("partition: {scheme: 'file:split.json'}\nsupernet: {path: ../sn}\n"
                                "clients: {profiles: [pi4, profiles/board.yaml]}\n")
    monkeypatch.chdir(tmp_path)
    from rafl.federation.run_config import load_run_config

    cfg = load_run_config(b / "run.yaml", ["data.root=data"])
    assert cfg.partition.scheme == f"file:{b / 'split.json'}" and cfg.supernet.path == str(tmp_path / "sn")
    assert cfg.clients.profiles == ["pi4", str(b / "profiles" / "board.yaml")]  # a shipped name stays a name
    assert cfg.data.root == str(tmp_path / "data")  # a --set value: against the current folder


def test_parallel_runs_claim_distinct_run_dirs_and_never_remove_another(tmp_path, monkeypatch):
    """Default run-dir names go down to the second: two runs started together used to pick the same
    name, and the one that lost removed the other's run dir while cleaning up. A run now claims its
    dir (an atomic mkdir) before any work, so a second run takes `-2`, and a failing run removes only
    its own."""
    import time as _time

    from rafl.errors import UserInputError
    from rafl.stages import federate

    monkeypatch.setattr(_time, "strftime", lambda fmt, *a: "20260101-000000")
    out = tmp_path / "runs"
    sets = ["--set", "data.limit_per_class=10", "--set", "clients.n=3", "--set", "algorithm.name=fedgh",
            "--set", "clients.models=cnn4-small", "--set", "clients.feature_dim=8", "--set", "engine.rounds=1"]
    seen = []

    def failing_prepare(cfg, progress=True):  # the other run is preparing: its dir is claimed, empty
        seen.append(sorted(p.name for p in out.iterdir()))
        raise UserInputError("a bad profile, say", field="clients.profiles")

    (out / "fedgh-digits-20260101-000000").mkdir(parents=True)  # a parallel run's claimed, still empty dir
    monkeypatch.setattr(federate, "prepare", failing_prepare)
    line = _one_error_line(_invoke(["--out", str(out), *sets]))
    assert "a bad profile, say" in line
    assert seen == [["fedgh-digits-20260101-000000", "fedgh-digits-20260101-000000-2"]]  # claimed before work
    assert sorted(p.name for p in out.iterdir()) == ["fedgh-digits-20260101-000000"]  # only its own removed


@pytest.mark.slow
def test_a_partition_file_whose_clients_hold_the_supernets_pool_is_refused(tmp_path, tiny_supernet):
    """The supernet trained on carve_public_pool(labels, 0.3, seed 0). A saved split is checked by its
    clients' indices (its own pool need not match the config's public_fraction): one that hands
    pool images to a client is exit 2 naming the file; one that avoids the pool runs."""
    import numpy as np

    from rafl.data import carve_public_pool, load_dataset, make_partition

    path, _ = tiny_supernet
    labels = load_dataset("digits", limit_per_class=10).labels.numpy()
    part = make_partition(labels, "iid", 3, 0, public_fraction=0.3, public_seed=0)
    part.save(tmp_path / "ok.json")
    pool = carve_public_pool(labels, 0.3, 0)
    import dataclasses

    first = dataclasses.replace(part.clients[0], train=np.sort(np.concatenate([part.clients[0].train, pool[:5]])))
    dataclasses.replace(part, clients=[first, *part.clients[1:]],
                        public=np.setdiff1d(part.public, pool[:5])).save(tmp_path / "leak.json")
    sets = ["--set", f"supernet.path={path}", "--set", "data.limit_per_class=10", "--set", "clients.n=3",
            "--set", "engine.rounds=1", "--set", "algorithm.local_epochs=1", "--set", "search.generations=1"]
    out = tmp_path / "runs"
    line = _one_error_line(_invoke(["--out", str(out), *sets, "--set", f"partition.scheme=file:{tmp_path / 'leak.json'}"]))
    assert line.startswith(f"error: {tmp_path / 'leak.json'}: partition.scheme: its clients hold 5 samples (e.g. index ")
    assert "of the public pool the supernet trained on, carve_public_pool(labels, 0.3, seed=0)" in line
    bad = json.loads((tmp_path / "ok.json").read_text())  # a malformed file: its own field is named too
    bad["clients"]["1"]["train"] = []
    (tmp_path / "empty.json").write_text(json.dumps(bad))
    line = _one_error_line(_invoke(["--out", str(out), *sets, "--set", f"partition.scheme=file:{tmp_path / 'empty.json'}"]))
    assert "partition.scheme: clients.1.train: is empty; allowed: at least one training sample" in line
    assert not out.exists()
    res = _invoke(["--quiet", "--out", str(out), *sets, "--set", f"partition.scheme=file:{tmp_path / 'ok.json'}"])
    assert res.exit_code == 0, res.output


def test_summary_prints_small_communication_in_a_unit_that_shows_it(tmp_path, capsys):
    """440 bytes uploaded per client per round printed as '0.000 MB' (and the total as 0.01 MB)."""
    from rafl.cli.federate import print_table
    from rafl.reports.tables import fmt_bytes

    assert [fmt_bytes(n) for n in (0, 440, 999, 1000, 8_800, 1_234_567, 2.5e9)] == [
        "0 B", "440 B", "999 B", "1 kB", "8.8 kB", "1.23 MB", "2.5 GB"]
    row = {"client": 0, "profile": "pi4", "macs_m": 1.0, "params_m": 0.1, "n_train": 10, "n_test": 5,
           "model.acc": 0.5, "arch": "r12_k3e3"}
    summary = {"algorithm": "fedproto", "rounds": 2, "table": [row], "means": {"model.acc": 0.5}, "final": {},
               "cum_mb": 0.00968, "cum_bytes_up": 880, "cum_bytes_down": 8_800,
               "mean_bytes_up_per_client_per_round": 440.0, "co_mb_to_target": 0.00484, "target_accuracy": 0.4,
               "failures": 0}
    print_table(summary, tmp_path)
    out = " ".join(capsys.readouterr().out.split())
    assert ("communication: 9.68 kB total (up 880 B, down 8.8 kB); upload per client per round 440 B; "
            "4.84 kB to reach accuracy 0.4") in out, out


_FAST = ["--set", "data.limit_per_class=10", "--set", "clients.n=3", "--set", "algorithm.name=fedgh",
         "--set", "clients.models=cnn4-small", "--set", "clients.feature_dim=8", "--set", "engine.rounds=1",
         "--set", "name=killed"]


def test_a_run_killed_before_its_first_checkpoint_reruns_under_the_same_name(tmp_path):
    """What `kill -9` in round 1 leaves (config.yaml, clients.json, a client state, an orphaned temp
    file, no checkpoint) is started afresh under the same name, with a warning; while a live run
    holds the folder's lock, the rerun is refused and the folder untouched."""
    from rafl.io import lock_dir

    run_dir = tmp_path / "runs" / "killed"
    (run_dir / "clients").mkdir(parents=True)
    for name in ("config.yaml", "clients.json", "clients/0000001.r00001.st", ".metrics.jsonl.x1y2.tmp"):
        (run_dir / name).write_text("left by a killed run")
    fd = lock_dir(run_dir)  # a live run's claim
    try:
        line = _one_error_line(_invoke(["--out", str(tmp_path / "runs"), *_FAST]))
        assert "killed: name: another run is writing into this folder now" in line, line
        assert (run_dir / "clients" / "0000001.r00001.st").read_text() == "left by a killed run"
    finally:
        import os

        os.close(fd)
    res = _invoke(["--out", str(tmp_path / "runs"), *_FAST])
    assert res.exit_code == 0, res.output
    assert "never completed a round (its run was killed before the first checkpoint): starting it afresh" in res.output
    assert (run_dir / "checkpoint.safetensors").is_file() and not list(run_dir.glob(".*.tmp"))
    assert sorted(p.name for p in (run_dir / "clients").iterdir()) == [f"{i:07d}.r00001.st" for i in range(3)]
    # a completed run keeps its name: refused as before
    assert "already exists (choose another name" in _one_error_line(_invoke(["--out", str(tmp_path / "runs"), *_FAST]))
    # --resume removes what a kill mid-write left: temp files of the run dir and of clients/
    (run_dir / ".checkpoint.safetensors.ab12.tmp").write_bytes(b"half")
    (run_dir / "clients" / ".0000000.r00002.st.cd34.tmp").write_bytes(b"half")
    (run_dir / ".plots.ef56.tmp").mkdir()
    res = _invoke(["--resume", str(run_dir), "--set", "engine.rounds=2"])
    assert res.exit_code == 0, res.output
    assert not list(run_dir.glob(".*.tmp")) and not list((run_dir / "clients").glob(".*.tmp"))
