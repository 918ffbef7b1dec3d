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

from rafl.federation import flower_fleet

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


@pytest.mark.slow
def test_the_deployment_guide_runs_as_written(tmp_path):
    """A SuperLink with TLS and --enable-supernode-auth, two registered SuperNodes and a
    two-round rafl run, all by the guide's own commands; the run completes (its log says so and
    the SuperLink records it as completed) and the nodes' authentication was in force."""
    home = tmp_path / "home"
    home.mkdir()
    script = "set -euo pipefail\n" + "\n".join(_blocks("bash")) + f"\necho {DONE}\nwait\n"
    env = {**os.environ, "HOME": str(home), "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                                                      os.environ.get("PATH", "")])}
    for key in ("FLWR_HOME", "RAFL_FLOWER_STATE_DIR", "RAFL_FLOWER_DATA_ROOTS", "RAFL_FLOWER_PLUGINS",
                "RAFL_FLOWER_SHARED_STATE_DIRS"):
        env.pop(key, None)
    log = tmp_path / "guide.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    fleet = home / "rafl-fleet"
    try:
        # the guide's last command done (bounded: a hung step fails the test, it does not hang it);
        # `wait` then keeps the shell, and so the SuperLink and SuperNodes below it, alive
        deadline_s = 900
        import time

        end = time.monotonic() + deadline_s
        while DONE not in log.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.5)
        text = log.read_text()
        logs = "".join(f"\n==> {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted(fleet.glob("*.log")))
        assert DONE in text, (text[-4000:], logs)
        run_log = (fleet / "run.log").read_text()
        assert "rafl: 2 rounds" in run_log and "runs/first" in run_log, (run_log[-3000:], logs)
        run_id = int(re.search(r"Successfully started run (\d+)", run_log).group(1))
        ls = subprocess.run(["flwr", "ls", "my-superlink", "--run-id", str(run_id), "--format", "json"],
                            capture_output=True, text=True, env=env, cwd=fleet, timeout=120, check=False)
        assert '"finished:completed"' in ls.stdout, (ls.stdout + ls.stderr, logs)
        listed = subprocess.run(["flwr", "supernode", "list", "my-superlink", "--format", "json"],
                                capture_output=True, text=True, env=env, cwd=fleet, timeout=120, check=False)
        assert listed.stdout.count('"node-id"') >= 2, (listed.stdout + listed.stderr)[-2000:]
        # an unregistered key is turned away (authentication in force)
        subprocess.run(["ssh-keygen", "-t", "ecdsa", "-b", "384", "-N", "", "-q", "-f", "keys/stranger"], cwd=fleet,
                       check=True, env=env, timeout=60)
        stranger = subprocess.run(["flower-supernode", "--superlink", "127.0.0.1:9091", "--root-certificates",
                                   "certs/ca.crt", "--auth-supernode-private-key", "keys/stranger", "--port", "9096",
                                   "--max-retries", "0"], capture_output=True, text=True, env=env, cwd=fleet,
                                  timeout=300, check=False)
        assert stranger.returncode != 0, (stranger.stdout + stranger.stderr)[-2000:]
    finally:
        started = flower_fleet.descendants([proc.pid])  # the SuperLink, SuperNodes and what they started
        flower_fleet.stop_process_trees([proc])
    assert started and not [pid for pid in started if flower_fleet._alive(pid)]
    summary = (fleet / "runs" / "first" / "summary.json").read_text()
    assert '"backend": "flower-superlink"' in summary
