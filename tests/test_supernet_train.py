"""Progressive-shrinking training: phases, resume equivalence, CLI smoke and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from rafl.cli import cli
from rafl.errors import UserInputError
from rafl.supernet import SearchSpace, load_supernet
from rafl.supernet.server_data import cutout, random_crop_flip, server_split
from rafl.supernet.train import TrainConfig, phase_choices, sample_step_archs, soft_cross_entropy, train_supernet

TINY = dict(width_mult=0.25, resolutions=(12, 16), image_size=16, limit_per_class=12, batch_size=16,
            epochs_full=1, epochs_kernel=1, epochs_depth=1, epochs_expand=1, recal_batches=2)


def test_phase_choices_follow_progressive_shrinking():
    space = SearchSpace()
    assert phase_choices(space, "full", 0)["ks"] == (7,)
    assert phase_choices(space, "kernel", 0) == {"ks": (3, 5, 7), "e": (6,), "d": (4,), "r": (24, 28, 32)}
    assert phase_choices(space, "depth", 0)["d"] == (3, 4)
    assert phase_choices(space, "depth", 1)["d"] == (2, 3, 4)
    assert phase_choices(space, "expand", 0)["e"] == (4, 6)
    assert phase_choices(space, "expand", 1)["e"] == (3, 4, 6)
    rng = np.random.default_rng(0)
    archs = sample_step_archs(space, "expand", 1, rng, sandwich=True, n_subnets=2)
    assert archs[0] == space.largest() and archs[1] == space.smallest() and len(archs) == 4
    kernel = sample_step_archs(space, "kernel", 0, rng, sandwich=True, n_subnets=1)
    assert all(a.d == (4,) * 5 and set(a.e) == {6} for a in kernel)


def test_soft_cross_entropy_matches_definition():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    expected = -(torch.log_softmax(logits, 1) * probs).sum(1).mean()
    assert torch.isclose(soft_cross_entropy(logits, probs), expected)
    # with a one-hot target it is the ordinary cross-entropy
    onehot = torch.nn.functional.one_hot(torch.tensor([0, 1]), 2).float()
    assert torch.isclose(soft_cross_entropy(logits, onehot),
                         torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])))


def test_server_split_is_the_public_pool_only():
    from rafl.data import carve_public_pool, load_dataset

    ds = load_dataset("digits", resolution=8)
    split = server_split(ds, 0.3, 0, 0.1)
    pool = carve_public_pool(ds.labels.numpy(), 0.3, 0)
    assert np.array_equal(np.sort(np.concatenate([split.pool_train, split.pool_val])), pool)
    assert not set(split.test) & set(pool)
    assert len(split.test) == len(ds) - len(pool)
    assert abs(len(split.pool_val) - 0.1 * len(pool)) <= 10
    again = server_split(ds, 0.3, 0, 0.1)
    assert np.array_equal(again.pool_train, split.pool_train)


def test_random_crop_flip_shapes_and_determinism():
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).reshape(2, 3, 6, 6)
    a = random_crop_flip(x, 2, True, torch.Generator().manual_seed(0))
    b = random_crop_flip(x, 2, True, torch.Generator().manual_seed(0))
    assert a.shape == x.shape and torch.equal(a, b)
    assert torch.equal(random_crop_flip(x, 0, False, torch.Generator()), x)
    # every crop is a shifted window of the zero-padded image
    shifted = random_crop_flip(x, 1, False, torch.Generator().manual_seed(3))
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    windows = [padded[0, :, i:i + 6, j:j + 6] for i in range(3) for j in range(3)]
    assert any(torch.equal(shifted[0], w) for w in windows)


def test_cutout_zeroes_one_clipped_square_per_sample():
    x = torch.ones(64, 3, 8, 8)
    a = cutout(x, 4, torch.Generator().manual_seed(0))
    assert torch.equal(a, cutout(x, 4, torch.Generator().manual_seed(0))) and torch.equal(cutout(x, 0, None), x)
    holes = (a == 0).all(1)  # (B, H, W): every channel of a cut pixel is 0
    assert torch.equal((a == 0).any(1), holes)
    for hole in holes:  # one axis-aligned rectangle, at most 4 x 4, clipped at the border
        rows, cols = hole.any(1).nonzero().flatten(), hole.any(0).nonzero().flatten()
        assert 2 <= len(rows) <= 4 and 2 <= len(cols) <= 4 and int(hole.sum()) == len(rows) * len(cols)
        assert rows.tolist() == list(range(rows[0], rows[-1] + 1))
    assert int(holes.sum(dim=(1, 2)).lt(16).sum()) > 0  # some squares were clipped at the border


@pytest.mark.slow
def test_a_run_started_before_a_field_existed_resumes_with_its_default(tmp_path):
    cfg = TrainConfig(**TINY)
    torch.set_num_threads(1)
    train_supernet(cfg, tmp_path / "a", progress=False, stop_after_epochs=1)
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    del saved["cutout"]  # the run's config.json as written before the field existed
    (tmp_path / "a" / "config.json").write_text(json.dumps(saved))
    _, metrics = train_supernet(cfg, tmp_path / "a", progress=False, resume=True, stop_after_epochs=1)
    assert len(metrics["phases"]) == 2
    with pytest.raises(UserInputError, match="cutout"):
        train_supernet(cfg.model_copy(update={"cutout": 8}), tmp_path / "a", resume=True, progress=False)


@pytest.mark.slow
def test_resume_gives_the_same_result(tmp_path):
    cfg = TrainConfig(**TINY)
    torch.set_num_threads(1)
    net_a, metrics_a = train_supernet(cfg, tmp_path / "a", progress=False)
    _, partial = train_supernet(cfg, tmp_path / "b", progress=False, stop_after_epochs=2)
    assert "test" not in partial and not (tmp_path / "b" / "supernet.json").exists()
    net_b, metrics_b = train_supernet(cfg, tmp_path / "b", progress=False, resume=True)
    sa, sb = net_a.state_dict(), net_b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert metrics_a["test"] == metrics_b["test"]
    assert [p["phase"] for p in metrics_a["phases"]] == ["full", "kernel", "depth", "expand"]
    # outputs: the checkpoint loads (also with weights_only torch.load for the resume state)
    loaded = load_supernet(tmp_path / "a")
    assert loaded.space == cfg.space(10)
    state = torch.load(tmp_path / "a" / "resume.pt", weights_only=True)
    assert state["phase"] == 3
    assert json.loads((tmp_path / "a" / "config.json").read_text())["width_mult"] == 0.25
    # an existing run is not overwritten without --resume
    with pytest.raises(UserInputError, match="already holds"):
        train_supernet(cfg, tmp_path / "a", progress=False)
    # a truncated resume checkpoint is a clear error
    data = (tmp_path / "b" / "resume.pt").read_bytes()
    (tmp_path / "b" / "resume.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(UserInputError, match="truncated"):
        train_supernet(cfg, tmp_path / "b", resume=True, progress=False)
    # resuming with another config is refused, naming the field
    with pytest.raises(UserInputError, match="seed"):
        train_supernet(cfg.model_copy(update={"seed": 5}), tmp_path / "a", resume=True, progress=False)


@pytest.mark.slow
def test_cli_smoke_digits(tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["supernet", "train", "--dataset", "digits", "--out", str(out),
                                   "--epochs-per-phase", "1", "--width-mult", "0.25", "--resolutions", "12,16",
                                   "--limit-per-class", "10", "--batch-size", "16", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "largest" in res.output and "smallest" in res.output and "%" in res.output
    for name in ("supernet.safetensors", "supernet.json", "config.json", "metrics.json", "resume.pt"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["test"]) == {"smallest", "middle", "largest"}
    assert all(0.0 <= v <= 1.0 for v in metrics["test"].values())
    # resuming a finished run is a no-op that prints the same table
    res2 = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(out), "--no-progress"])
    assert res2.exit_code == 0, res2.output
    assert json.loads((out / "metrics.json").read_text())["test"] == metrics["test"]
    # `rafl supernet info` describes it; a missing folder is a clear error
    res3 = CliRunner().invoke(cli, ["supernet", "info", str(out)])
    assert res3.exit_code == 0, res3.output
    assert "feature width D = 320" in res3.output and "expand" in res3.output
    assert CliRunner().invoke(cli, ["supernet", "info", str(tmp_path / "none")]).exit_code == 2
    # ... and so are truncated weights (info verifies them, not only the JSON)
    weights = next(out.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    res4 = CliRunner().invoke(cli, ["supernet", "info", str(out)])
    assert res4.exit_code == 2 and "error:" in res4.output, res4.output


@pytest.mark.parametrize("args, needle", [
    (["--dataset", "mnist", "--out", "X"], "dataset"),
    (["--dataset", "cifar10", "--out", "X"], "data_root"),
    (["--out", "X", "--epochs-per-phase", "-1"], "epochs_"),
    (["--out", "X", "--width-mult", "0"], "width_mult"),
    (["--out", "X", "--device", "tpu"], "device"),
    (["--out", "X", "--resolutions", "a,b"], "--resolutions"),
    (["--epochs-per-phase", "1"], "--out"),
    (["--resume", "NOPE"], "NOPE: --resume: does not exist"),
    (["--out", "X", "--resolutions", "12,,14"], "--resolutions: is '12,,14', allowed: comma-separated integers"),
    # 2000 px was killed for memory at 22 GB, leaving a folder that could be neither resumed nor reused
    (["--out", "X", "--resolutions", "2000"], "in 4..1024"),
    (["--resume", "NOPE", "--config", "c.yaml"], "--config: cannot be combined with --resume"),
])
def test_cli_bad_input_exits_2(tmp_path, args, needle):
    args = [str(tmp_path / a) if a in ("X", "NOPE") else a for a in args]
    res = CliRunner().invoke(cli, ["supernet", "train", *args, "--no-progress"])
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not (tmp_path / "X").exists()


@pytest.mark.slow
def test_quickstart_trains_once_then_loads_from_cache(tmp_path, monkeypatch, capsys):
    from rafl.supernet import quickstart as qs

    monkeypatch.setenv("RAFL_CACHE_DIR", str(tmp_path / "cache"))
    tiny = TrainConfig(**{**TINY, "epochs_kernel": 0, "epochs_depth": 0, "epochs_expand": 1})
    monkeypatch.setattr(qs, "quickstart_config", lambda: tiny)
    net, path = qs.quickstart_supernet(progress=False)
    err = capsys.readouterr().err
    assert "training the quickstart supernet" in err and str(path) in err
    assert path.parent == tmp_path / "cache" and path.name.startswith("quickstart-supernet-")
    assert (path / "supernet.json").is_file() and not list(path.parent.glob(".*tmp"))
    net2, path2 = qs.quickstart_supernet(progress=False)
    assert path2 == path and "training" not in capsys.readouterr().err
    sa, sb = net.state_dict(), net2.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # the hash covers the config: another config gets another folder
    assert qs.quickstart_dir(tiny.model_copy(update={"seed": 1})) != path


def test_cli_help_states_the_config_defaults():
    res = CliRunner().invoke(cli, ["supernet", "train", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    defaults = TrainConfig()
    assert "[default: " + ", ".join(str(e) for e in defaults.phase_epochs()) + "]" in text
    assert f"[default: {defaults.batch_size}]" in text and f"[default: {defaults.width_mult}]" in text
    assert ",".join(str(r) for r in defaults.resolutions) in text


@pytest.mark.parametrize("options, msg", [({"epochs": 2}, r"epochs: unknown key; allowed: .*epochs_full.*epochs_per_phase"),
                                          ({"image_size": 4}, r"image_size: .*allowed: resolution"),
                                          # the search space's checks, naming the file (they ran at train time, unnamed)
                                          ({"ks_choices": [4]}, r"^cfg.yaml: ks_choices: kernel sizes must be odd"),
                                          ({"e_choices": [-1]}, r"^cfg.yaml: e_choices: expand ratios must be >= 1"),
                                          ({"resolutions": [2000]}, r"^cfg.yaml: resolutions \[2000\]: allowed: "
                                                                    r"integers in 4..1024")])
def test_train_config_errors_name_the_field_and_allowed_values(options, msg):
    from rafl.supernet.train import TrainConfig

    with pytest.raises(UserInputError, match=msg):
        TrainConfig.from_options("cfg.yaml", **options)


def test_epochs_per_phase_errors_name_epochs_per_phase():
    from rafl.supernet.train import TrainConfig

    with pytest.raises(UserInputError, match=r"^epochs_per_phase: .*greater than or equal to 0"):
        TrainConfig.from_options(None, epochs_per_phase=-1)


def test_cli_diverged_training_is_one_error_naming_the_phase_lr_and_leaves_nothing(tmp_path):
    """A NaN/Inf loss stops training with one line naming lr_<phase>; a fresh run dir is removed
    (its checkpoints could not be resumed with another lr); an existing empty --out stays empty."""
    cfg = tmp_path / "huge-lr.yaml"
    cfg.write_text("lr_full: 1.0e+30\n")
    for out in (tmp_path / "run", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        res = CliRunner().invoke(cli, ["supernet", "train", "--config", str(cfg), "--out", str(out),
                                       "--epochs-per-phase", "1", "--width-mult", "0.25", "--resolutions", "12",
                                       "--limit-per-class", "10", "--batch-size", "16", "--no-progress"])
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1, res.output
        assert "lr_full: supernet training diverged in phase full" in lines[0] and "smaller lr_full" in lines[0]
        assert (not out.exists()) if out.name == "run" else (out.is_dir() and not any(out.iterdir()))


@pytest.mark.slow
def test_cli_resume_with_a_config_that_does_not_fit_the_checkpoint_is_one_error(tmp_path):
    out = tmp_path / "run"
    args = ["--epochs-per-phase", "1", "--width-mult", "0.25", "--resolutions", "12", "--limit-per-class", "10",
            "--batch-size", "16", "--no-progress"]
    assert CliRunner().invoke(cli, ["supernet", "train", "--out", str(out), *args]).exit_code == 0
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "width_mult": 0.5}))   # edited by hand
    res = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(out), "--no-progress"])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "resume.pt: resume: its weights do not fit the supernet config.json describes (size mismatch" in lines[0]


def test_a_dataset_without_data_root_is_one_clear_line_and_honours_rafl_data_root(monkeypatch):
    """The cross-field check reads as one sentence (no pydantic prefix, no dump of every option),
    and ``$RAFL_DATA_ROOT`` is the default data root, as for ``rafl data`` and the run config."""
    from rafl.errors import UserInputError

    monkeypatch.delenv("RAFL_DATA_ROOT", raising=False)
    with pytest.raises(UserInputError) as err:
        TrainConfig.from_options(dataset="cifar10", epochs_per_phase=1)
    assert str(err.value) == ("dataset 'cifar10' needs a data root: --data-root (config key data_root) "
                              "or $RAFL_DATA_ROOT")
    monkeypatch.setenv("RAFL_DATA_ROOT", "/some/where")
    assert TrainConfig.from_options(dataset="cifar10", epochs_per_phase=1).data_root == "/some/where"
    assert TrainConfig.from_options(dataset="cifar10", data_root="/given").data_root == "/given"


@pytest.mark.slow
def test_cli_refuses_a_foreign_folder_and_resumes_a_run_stopped_before_its_first_checkpoint(tmp_path):
    """--out into a non-empty folder that is no supernet run is refused (data, search and profile
    refuse it too); a run killed before its first epoch ended (config.json, no resume.pt) starts over
    on --resume instead of being a folder neither --resume nor a rerun accepts; a relative
    --data-root is recorded absolute."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    res = CliRunner().invoke(cli, ["supernet", "train", "--out", str(other), "--no-progress"])
    assert res.exit_code == 2 and "--out: is not empty; allowed: a new or empty folder" in res.output, res.output
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    # another tool's config.json is no supernet run: --out is refused as foreign (it was called "a
    # supernet run"), and --resume refuses it instead of starting a run there with the defaults
    (other / "config.json").write_text("{}")
    res = CliRunner().invoke(cli, ["supernet", "train", "--out", str(other), "--no-progress"])
    assert res.exit_code == 2 and "--out: is not empty; allowed: a new or empty folder" in res.output, res.output
    res = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(other), "--no-progress"])
    assert res.exit_code == 2 and "not written by `rafl supernet train`" in res.output, res.output
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "notes.txt"]
    out = tmp_path / "run"
    args = ["--dataset", "digits", "--epochs-per-phase", "1", "--width-mult", "0.25", "--resolutions", "12",
            "--limit-per-class", "10", "--batch-size", "16", "--no-progress"]
    train_supernet(TrainConfig.from_options(dataset="digits", epochs_per_phase=1, width_mult=0.25, resolutions=(12,),
                                            limit_per_class=10, batch_size=16), out, progress=False,
                   stop_after_epochs=1)
    (out / "resume.pt").unlink()  # as if killed inside its first epoch
    res = CliRunner().invoke(cli, ["supernet", "train", "--out", str(out), *args])
    assert res.exit_code == 2 and "use --resume" in res.output
    res = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(out), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (out / "supernet.safetensors").is_file() and "largest" in res.output


def test_cli_data_root_is_taken_against_the_current_folder_or_the_config_file(tmp_path, monkeypatch):
    """Recorded absolute (config.json), so --resume works from another folder: --data-root against
    the current folder, a config file's data_root against the file's folder."""
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["supernet", "train", "--dataset", "cifar10", "--data-root", "c10",
                                   "--out", "o", "--no-progress"])
    assert res.exit_code == 2 and str(tmp_path / "c10") in res.output, res.output
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "t.yaml").write_text("dataset: cifar10\ndata_root: ../data/c10\n")
    res = CliRunner().invoke(cli, ["supernet", "train", "--config", "cfg/t.yaml", "--out", "o", "--no-progress"])
    assert res.exit_code == 2 and str(tmp_path / "data" / "c10") in res.output, res.output
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_resolution_whose_largest_subnet_cannot_train_in_memory_is_refused_before_writing(tmp_path, monkeypatch):
    """``--resolutions 1024`` filled this machine's 23 GiB within 25 s: the cost model's training
    memory of the largest subnet (a lower bound) over the device's memory is one error naming
    ``resolutions``, the memory and what fits; nothing is written. A run that fits is untouched."""
    import rafl.search.cost as train_mod

    monkeypatch.setattr(train_mod, "device_memory_bytes", lambda device: 4 * 2**30)  # a 4 GiB device
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["supernet", "train", "--out", str(out), "--resolutions", "32,512",
                                   "--limit-per-class", "10", "--no-progress"])
    assert res.exit_code == 2, res.output
    assert "resolutions: training the largest subnet at 512 px with batch_size 32 needs at least" in res.output
    assert "(cpu memory is 4.0 GiB); allowed: resolutions well below " in res.output, res.output
    assert not out.exists()
    big = TrainConfig.from_options(dataset="digits", resolutions=(512,))
    with pytest.raises(UserInputError, match=r"needs at least 26\.\d GiB"):  # 27,338 MiB (cost model, width 0.35)
        train_mod.check_training_memory(big, 10, torch.device("cpu"))
    train_mod.check_training_memory(TrainConfig.from_options(dataset="digits", resolutions=(32,)), 10,
                                    torch.device("cpu"))


@pytest.mark.slow
def test_a_resume_of_a_folder_a_live_run_writes_into_is_refused(tmp_path):
    """The writing run holds rafl.io.lock_dir on its folder (here: this process holds it, as a live
    training would): --resume is one error naming the folder, nothing changes; once released (the
    run ended, or died: the kernel drops the lock) the same --resume continues."""
    import os

    from rafl.io import lock_dir

    out = tmp_path / "run"
    train_supernet(TrainConfig.from_options(dataset="digits", epochs_per_phase=1, width_mult=0.25, resolutions=(12,),
                                            limit_per_class=10, batch_size=16), out, progress=False,
                   stop_after_epochs=1)
    before = (out / "resume.pt").read_bytes()
    fd = lock_dir(out)
    try:
        res = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(out), "--no-progress"])
    finally:
        os.close(fd)
    assert res.exit_code == 2, res.output
    assert f"{out}: resume: another run is writing into this folder now" in res.output, res.output
    assert (out / "resume.pt").read_bytes() == before
    res = CliRunner().invoke(cli, ["supernet", "train", "--resume", str(out), "--no-progress"])
    assert res.exit_code == 0 and (out / "supernet.safetensors").is_file(), res.output
