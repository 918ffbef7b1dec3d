"""docs/deployment.md runs as written: every ``bash`` block, in order, on 127.0.0.1 with TLS
(openssl-made certificates) and SuperNode authentication (registered keys), with ``HOME`` a
temporary folder; everything the guide starts is stopped afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rafl.stages.flower import fleet as flower_fleet

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
DONE = "rafl-guide-done"


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"^```{kind}\n(.*?)^```$", GUIDE.read_text(), flags=re.M | re.S)


def test_the_guide_keeps_tls_and_auth_as_its_main_path_and_insecure_as_a_marked_shortcut():
    """The commands run by the test below use TLS and SuperNode authentication; `--insecure`
    appears only in the shortcut's `sh` block, under its warning."""
    run = "\n".join(_blocks("bash"))
    assert "--insecure" not in run and "insecure = true" not in run
    assert "--enable-supernode-auth" in run and "flwr supernode register" in run and "--ssl-certfile" in run
    assert "--root-certificates" in run and "--auth-supernode-private-key" in run
    text = GUIDE.read_text()
    assert text.index("**Insecure: for one machine only.**") < text.index("flower-superlink --insecure")
    assert "docs/deployment.md" in (GUIDE.parents[1] / "README.md").read_text()  # linked from the README


def _start(blocks: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    """``blocks`` in one bash (``set -euo pipefail``), then ``echo DONE`` and ``wait``: the shell,
    and so what the blocks started in the background, lives until stopped."""
    script = "set -euo pipefail\n" + "\n".join(blocks) + f"\necho {DONE}\nwait\n"
    with log.open("w") as out:
        return subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _until(condition, what: str, timeout: float = 900) -> None:
    """Wait until ``condition()`` holds; a bound for "never", not a speed check (a loaded machine
    may take long)."""
    import time

    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"{what} within {timeout:g} s"
        time.sleep(0.5)


def _online(env: dict, cwd: Path) -> int:
    import json

    listed = subprocess.run(["flwr", "supernode", "list", "my-superlink", "--format", "json"], capture_output=True,
                            text=True, env=env, cwd=cwd, timeout=120, check=False)
    try:
        return sum(n["status"] == "online" for n in json.loads(listed.stdout)["nodes"])
    except (ValueError, KeyError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.slow
def test_the_deployment_guide_runs_as_written(tmp_path):
    """A SuperLink with TLS and --enable-supernode-auth, two registered SuperNodes and a
    two-round rafl run, all by the guide's own commands; the run completes (its log says so and
    the SuperLink records it as completed), an unregistered key is turned away, and after a
    SuperLink restart the guide's section 7 (the SuperLink's, register and SuperNode commands
    again) brings both nodes back online."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                      os.environ.get("PATH", "")])}
    for key in ("FLWR_HOME", "RAFL_FLOWER_STATE_DIR", "RAFL_FLOWER_DATA_ROOTS", "RAFL_FLOWER_PLUGINS",
                "RAFL_FLOWER_SHARED_STATE_DIRS"):
        env.pop(key, None)
    log = tmp_path / "guide.log"
    blocks = _blocks("bash")
    proc = _start(blocks, home, env, log)
    shells = [proc]
    fleet = home / "rafl-fleet"
    try:
        _until(lambda: DONE in log.read_text() or proc.poll() is not None, "the guide's commands ended")
        text = log.read_text()
        logs = "".join(f"\n==> {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(fleet.glob("*.log")))
        assert DONE in text, (text[-4000:], logs)
        run_log = (fleet / "run.log").read_text()
        assert "rafl: 2 rounds" in run_log and "runs/first" in run_log, (run_log[-3000:], logs)
        run_id = int(re.search(r"Successfully started run (\d+)", run_log).group(1))
        ls = subprocess.run(["flwr", "ls", "my-superlink", "--run-id", str(run_id), "--format", "json"],
                            capture_output=True, text=True, env=env, cwd=fleet, timeout=120, check=False)
        assert '"finished:completed"' in ls.stdout, (ls.stdout + ls.stderr, logs)
        assert _online(env, fleet) == 2
        # an unregistered key is turned away (authentication in force)
        subprocess.run(["ssh-keygen", "-t", "ecdsa", "-b", "384", "-N", "", "-q", "-f", "keys/stranger"], cwd=fleet,
                       check=True, env=env, timeout=60)
        with (fleet / "stranger.log").open("w") as out:
            stranger = subprocess.Popen(["flower-supernode", "--superlink", "127.0.0.1:9091", "--root-certificates",
                                         "certs/ca.crt", "--auth-supernode-private-key", "keys/stranger", "--port",
                                         "9096", "--max-retries", "0"], stdout=out, stderr=subprocess.STDOUT, env=env,
                                        cwd=fleet, start_new_session=True)
        try:
            code = stranger.wait(timeout=300)  # a bound for "never refused", not a speed check
        finally:
            flower_fleet.stop_process_trees([stranger])  # and the SuperExec it started
        said = (fleet / "stranger.log").read_text()
        assert code != 0 and "Failed to activate SuperNode" in said, said[-2000:]

        # section 7: the SuperLink restarts (in-memory state); the SuperNodes' heartbeats are refused
        # and they exit; the guide's commands (sections 3-5) bring the fleet back
        below = flower_fleet.descendants([proc.pid])
        (superlink,) = [pid for pid in below if "flower-superlink" in _cmdline(pid)]
        nodes = [pid for pid in below if "flower-supernode" in _cmdline(pid)]
        assert len(nodes) == 2
        os.kill(superlink, 15)
        _until(lambda: not flower_fleet._alive(superlink), "the SuperLink stopped")
        pick = [b for b in blocks if "flower-superlink" in b or "config.toml" in b]
        again = _start(pick, fleet, env, tmp_path / "restart.log")
        shells.append(again)
        _until(lambda: DONE in (tmp_path / "restart.log").read_text() or again.poll() is not None, "restarted")
        assert DONE in (tmp_path / "restart.log").read_text(), (tmp_path / "restart.log").read_text()[-3000:]
        _until(lambda: not any(flower_fleet._alive(pid) for pid in nodes), "the old SuperNodes exited")
        pick = [b for b in blocks if "flwr supernode register" in b or "flower-supernode" in b]
        nodes_again = _start(pick, fleet, env, tmp_path / "nodes.log")
        shells.append(nodes_again)
        _until(lambda: _online(env, fleet) == 2, "both SuperNodes online again")
    finally:
        started = flower_fleet.descendants([p.pid for p in shells])  # SuperLink, SuperNodes, what they started
        flower_fleet.stop_process_trees(shells)
    assert started and not [pid for pid in started if flower_fleet._alive(pid)]
    summary = (fleet / "runs" / "first" / "summary.json").read_text()
    assert '"backend": "flower-superlink"' in summary
