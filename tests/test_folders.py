"""rafl.folders: the three kinds of output folders (a run, a comparison, an output written once),
each with its check, its lock and its cleanup on failure, and every command going through them."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from rafl.errors import UserInputError
from rafl.folders import NOT_A_FOLDER, Comparison, OnceKind, RunFolder, RunKind
from rafl.io import lock_dir
from rafl.stages.checks import FEDERATE_RUN, SEARCH_OUTPUT

REPO = Path(__file__).resolve().parents[1]

#: a run kind that refuses a run which never completed a step (as supernet training does)
STRICT = RunKind(started=lambda p: (p / "config.yaml").is_file(), completed=lambda p: (p / "ckpt").is_file(),
                 foreign="is someone else's", taken="holds a finished step of {path}", dead="holds a dead run",
                 step="epoch")


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


# ------------------------------------------------------------------------------------------ kind 1: run
def test_a_run_starts_in_a_new_or_empty_folder_and_a_failed_one_leaves_nothing(tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(RuntimeError):
        with RunFolder.start(out / "r", FEDERATE_RUN, field="name") as run:
            (run.path / "config.yaml").write_text("name: r\n")
            raise RuntimeError("round 1 failed")
    assert not out.exists()  # the run folder and the parent its claim created
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError):
        with RunFolder.start(tmp_path / "empty", FEDERATE_RUN) as run:
            (run.path / "config.yaml").write_text("name: r\n")
            (run.path / "clients").mkdir()
            raise RuntimeError("round 1 failed")
    assert _names(tmp_path / "empty") == []  # a folder that was there, empty, stays (empty)
    with pytest.raises(KeyboardInterrupt):
        with RunFolder.start(out / "r", FEDERATE_RUN) as run:
            (run.path / "config.yaml").write_text("name: r\n")
            (run.path / "checkpoint.safetensors").write_bytes(b"")
            raise KeyboardInterrupt
    assert _names(out / "r") == ["checkpoint.safetensors", "config.yaml"]  # a completed round is kept


def test_a_run_folder_refuses_a_file_foreign_files_and_a_completed_run(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match=f"file: --out: {re.escape(NOT_A_FOLDER)}"):
        RunFolder.start(tmp_path / "file", FEDERATE_RUN, field="--out")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserInputError, match="other: name: already exists and is not a rafl federate run dir "
                                             r"\(choose another name or --out\)"):
        RunFolder.start(other, FEDERATE_RUN, field="name")
    assert _names(other) == ["notes.txt"]
    done = tmp_path / "done"
    done.mkdir()
    (done / "config.yaml").write_text("name: done\n")
    (done / "checkpoint.safetensors").write_bytes(b"")
    with pytest.raises(UserInputError, match=r"already exists \(choose another name or --out, or --resume it\)"):
        RunFolder.start(done, FEDERATE_RUN)
    (done / "ckpt").write_bytes(b"")
    with pytest.raises(UserInputError, match=f"holds a finished step of {re.escape(str(done))}"):
        RunFolder.check_new(done, STRICT)
    assert _names(done) == ["checkpoint.safetensors", "ckpt", "config.yaml"]


def test_a_dead_run_is_taken_over_or_refused_as_its_kind_says_and_a_live_one_is_refused(tmp_path, capsys):
    dead = tmp_path / "dead"
    (dead / "clients").mkdir(parents=True)
    (dead / "config.yaml").write_text("left by a killed run")
    (dead / "clients" / "0.st").write_text("left by a killed run")
    with pytest.raises(UserInputError, match="dead: out: holds a dead run"):
        RunFolder.start(dead, STRICT, field="out")
    fd = lock_dir(dead)  # a live run's
    try:
        with pytest.raises(UserInputError, match="dead: name: another run is writing into this folder now"):
            RunFolder.start(dead, FEDERATE_RUN, field="name")
        with pytest.raises(UserInputError, match="another run is writing into this folder now"):
            RunFolder.reopen(dead, FEDERATE_RUN)
    finally:
        os.close(fd)
    assert _names(dead) == ["clients", "config.yaml"]
    with RunFolder.start(dead, FEDERATE_RUN) as run:  # its run died: taken over, emptied
        assert _names(run.path) == [] and not run.resumed
    assert "dead never completed a round (its run was killed before the first checkpoint): starting it afresh" in \
        capsys.readouterr().err


def test_a_resumed_run_is_never_discarded_and_default_names_never_collide(tmp_path):
    done = tmp_path / "done"
    done.mkdir()
    (done / "config.yaml").write_text("name: done\n")
    (done / "checkpoint.safetensors").write_bytes(b"")
    with pytest.raises(RuntimeError):
        with RunFolder.reopen(done, FEDERATE_RUN, field="--resume") as run:
            assert run.resumed
            (done / "checkpoint.safetensors").unlink()  # even one whose checkpoint went
            raise RuntimeError("round 2 failed")
    assert _names(done) == ["config.yaml"]
    with pytest.raises(RuntimeError, match="never discarded"):
        RunFolder.reopen(done, FEDERATE_RUN).discard()
    first = RunFolder.start_unique(tmp_path / "runs", "rafl-digits", FEDERATE_RUN)
    second = RunFolder.start_unique(tmp_path / "runs", "rafl-digits", FEDERATE_RUN)
    assert (first.path.name, second.path.name) == ("rafl-digits", "rafl-digits-2")
    second.discard()
    first.discard()
    assert not (tmp_path / "runs").exists()


def test_a_claimed_run_folder_stops_a_second_run_checked_before_it(tmp_path):
    out = tmp_path / "run"
    RunFolder.check_new(out, STRICT)  # both runs found it new; the first claims it
    with RunFolder.start(out, STRICT, claim="config.yaml"):
        (out / "config.yaml").write_text("")
    with pytest.raises(UserInputError, match="holds a dead run"):  # checked again, under the lock
        RunFolder.start(out, STRICT, claim="config.yaml")


# ------------------------------------------------------------------------------------------ kind 2: comparison
def test_a_comparison_starts_in_a_new_empty_or_tune_only_folder(tmp_path):
    Comparison.check_new(tmp_path / "new")
    (tmp_path / "tuned" / "tune" / "trial0").mkdir(parents=True)
    (tmp_path / "tuned" / "tune.json").write_text("{}")
    Comparison.check_new(tmp_path / "tuned")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(UserInputError, match=r"busy: --out: already exists and is not empty; choose another --out "
                                             r"\(or --resume it\)"):
        Comparison.check_new(tmp_path / "busy")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="file: --out: is a file"):
        Comparison.check_new(tmp_path / "file")
    with pytest.raises(UserInputError, match="nope: --resume: does not exist"):
        Comparison.check_resume(tmp_path / "nope")
    with pytest.raises(UserInputError, match=r"busy: --resume: is not a rafl compare output \(no config.yaml\)"):
        Comparison.check_resume(tmp_path / "busy")


def test_a_comparison_is_claimed_locked_and_leaves_nothing_when_its_first_method_fails(tmp_path):
    from rafl.stages.compare import METHOD_RUN

    out = tmp_path / "cmp"
    with Comparison.open(out, resume=False, field="--out") as cmp:
        with pytest.raises(UserInputError, match="another run is writing into this folder"):
            Comparison.open(out, resume=True, field="--resume")  # a live comparison's folder
        (out / "config.yaml").write_text("algorithms: {}\n")
        run = cmp.method("fedgh", METHOD_RUN, resume=False)
        (run.path / "clients.json").write_text("{}")
        cmp.discard_failed(run)
        run.close()
    assert not out.exists()  # its first method failed: nothing kept, the same command runs again
    # two comparisons started together into one folder: the second stops at the claim of config.yaml
    with Comparison.open(out, resume=False, field="--out"):
        pass
    with pytest.raises(UserInputError, match=r"another run is writing into this folder \(config.yaml appeared"):
        Comparison.open(out, resume=False, field="--out")


def test_a_comparisons_method_runs_are_run_folders(tmp_path, capsys):
    from rafl.stages.compare import METHOD_RUN

    out = tmp_path / "cmp"
    with Comparison.open(out, resume=False, field="--out") as cmp:
        (out / "config.yaml").write_text("algorithms: {}\n")
        with cmp.method("fedgh", METHOD_RUN, resume=False) as run:
            (run.path / "clients.json").write_text("{}")
            (run.path / "checkpoint.safetensors").write_bytes(b"")
        failed = cmp.method("fedtgp", METHOD_RUN, resume=False)
        (failed.path / "clients.json").write_text("{}")
        cmp.discard_failed(failed)  # a later method failed: it goes, the finished one and the record stay
        failed.close()
    assert _names(out) == ["config.yaml", "fedgh"]
    killed = out / "fedtgp"  # killed (kill -9) before its first round: --resume starts it afresh
    killed.mkdir()
    (killed / "clients.json").write_text("{}")
    with Comparison.open(out, resume=True, field="--resume") as cmp:
        with cmp.method("fedgh", METHOD_RUN, resume=True) as run:
            assert run.resumed
        (out / "fd").mkdir()
        (out / "fd" / "notes.txt").write_text("not a run")
        with pytest.raises(UserInputError, match="fd: already exists and is not a method's run dir of rafl compare"):
            cmp.method("fd", METHOD_RUN, resume=False)
        failed = cmp.method("fedtgp", METHOD_RUN, resume=False)
        assert _names(failed.path) == []
        cmp.discard_failed(failed)  # failed again: it goes; a resumed comparison keeps its record
        failed.close()
    assert "fedtgp never completed a round" in capsys.readouterr().err
    assert _names(out) == ["config.yaml", "fd", "fedgh"]


# ------------------------------------------------------------------------------------------ kind 3: written once
REPORT = OnceKind("`rafl report`", owns=lambda p: p.name in ("report.md", "report.png"))


def test_an_output_written_once_takes_a_new_empty_or_earlier_output_folder(tmp_path):
    REPORT.check(tmp_path / "new")
    (tmp_path / "empty").mkdir()
    REPORT.check(tmp_path / "empty")
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "report.md").write_text("old")
    (earlier / ".report.md.x1y2.tmp").write_text("left by a kill mid-write")
    REPORT.check(earlier)
    (earlier / "notes.txt").write_text("mine")
    (earlier / ".git").mkdir()
    with pytest.raises(UserInputError, match=r"earlier: --out: holds files that are not `rafl report` output "
                                             r"\(\.git, notes\.txt\); allowed: a new or empty folder, or one "
                                             "holding only `rafl report` output"):
        REPORT.check(earlier)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match=f"file: --out: {re.escape(NOT_A_FOLDER)}"):
        REPORT.check(tmp_path / "file")


def test_an_output_written_once_is_whole_or_untouched(tmp_path):
    out = tmp_path / "out"
    with REPORT.write(out) as tmp:
        (tmp / "report.md").write_text("first")
    assert _names(out) == ["report.md"]
    with pytest.raises(RuntimeError):
        with REPORT.write(out) as tmp:
            (tmp / "report.md").write_text("half")
            raise RuntimeError("the plot failed")
    assert (out / "report.md").read_text() == "first"  # the earlier output, untouched
    assert _names(tmp_path) == ["out"]  # no temporary folder left
    with REPORT.write(out) as tmp:
        (tmp / "report.png").write_text("second")
    assert _names(out) == ["report.png"]  # replaced as a whole


def test_a_search_replaces_only_its_own_profile_folders(tmp_path):
    out = tmp_path / "search"
    for name in ("pi4", "phone"):
        with SEARCH_OUTPUT.write(out, entry=name) as tmp:
            (tmp / "result.json").write_text(name)
    with SEARCH_OUTPUT.write(out, entry="pi4") as tmp:
        (tmp / "result.json").write_text("again")
    assert _names(out) == ["phone", "pi4"] and (out / "phone" / "result.json").read_text() == "phone"
    (out / "pi5").mkdir()  # no result.json: not a search's
    with pytest.raises(UserInputError, match=r"not `rafl search` output \(pi5\)"):
        SEARCH_OUTPUT.check(out)


# ------------------------------------------------------------------------------------------ every command
def test_no_module_but_rafl_folders_applies_the_folder_primitives():
    """The lock, the claim, the creatable probe and the atomic folder write are applied to output
    folders only by rafl.folders; rafl.io defines them, and the quickstart supernet's cache (not a
    command's output) is written with atomic_dir."""
    allowed = {"rafl/folders.py", "rafl/io.py", "rafl/supernet/quickstart.py:atomic_dir"}
    found = []
    for path in sorted((REPO / "rafl").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        text = path.read_text()
        for name in ("lock_dir", "claim_file", "check_output_dir", "atomic_dir"):
            if re.search(rf"\b{name}\(", text) and rel not in allowed and f"{rel}:{name}" not in allowed:
                found.append(f"{rel}: {name}")
    assert found == []


@pytest.mark.slow
def test_a_new_supernet_run_that_fails_before_its_first_epoch_leaves_nothing(tmp_path, monkeypatch):
    import rafl.supernet.train as train
    from rafl.supernet.train import TrainConfig, train_supernet

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(train, "_make_optimizer", fail)
    cfg = TrainConfig.from_options(dataset="digits", epochs_per_phase=1, width_mult=0.25, resolutions=(12,),
                                   limit_per_class=10, batch_size=16)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "run", tmp_path / "empty"):
        with pytest.raises(RuntimeError, match="out of memory"):
            train_supernet(cfg, out, progress=False)
    assert _names(tmp_path) == ["empty"] and _names(tmp_path / "empty") == []
