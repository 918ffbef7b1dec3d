"""RunDir: the one run-dir lifecycle of rafl federate, the Flower App and rafl compare's runs."""

from __future__ import annotations

import pytest

from rafl.errors import UserInputError
from rafl.stages.rundir import RunDir


def test_a_failed_new_run_leaves_nothing_and_a_checkpointed_one_stays(tmp_path):
    out = tmp_path / "runs"
    with pytest.raises(RuntimeError):
        with RunDir.claim(out, "r", default="unused") as rd:
            (rd.path / "config.yaml").write_text("name: r\n")
            raise RuntimeError("round 1 failed")
    assert not out.exists()  # the run dir and the --out folder this claim created
    with pytest.raises(RuntimeError):
        with RunDir.claim(out, "r", default="unused") as rd:
            (rd.path / "config.yaml").write_text("name: r\n")
            (rd.path / "checkpoint.safetensors").write_bytes(b"")
            raise RuntimeError("round 2 failed")
    assert (out / "r" / "checkpoint.safetensors").is_file()
    with pytest.raises(UserInputError, match="already exists .*--resume it"):
        RunDir.claim(out, "r", default="unused")


def test_default_names_never_collide_and_a_live_run_dir_is_refused(tmp_path, capsys):
    first = RunDir.claim(tmp_path, None, default="rafl-digits-20260101-000000")
    second = RunDir.claim(tmp_path, None, default="rafl-digits-20260101-000000")
    assert (first.path.name, second.path.name) == ("rafl-digits-20260101-000000", "rafl-digits-20260101-000000-2")
    (first.path / "config.yaml").write_text("name: x\n")  # never completed a round, but its run is alive
    with pytest.raises(UserInputError, match="another run is writing into this folder"):
        RunDir.claim(tmp_path, first.path.name, default="unused")
    first.close()
    again = RunDir.claim(tmp_path, first.path.name, default="unused")  # its run died: taken over, emptied
    assert "never completed a round" in capsys.readouterr().err
    assert list(again.path.iterdir()) == []
    for rd in (second, again):
        rd.close()
    with pytest.raises(UserInputError, match=r"allowed: a plain folder name"):
        RunDir.claim(tmp_path, "../x", default="unused")


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    with pytest.raises(UserInputError, match="nope: --resume: does not exist"):
        RunDir.resume(tmp_path / "nope")
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.yaml").write_text("name: new\n")
    with pytest.raises(UserInputError, match="never completed a round"):
        RunDir.resume(tmp_path / "new")
