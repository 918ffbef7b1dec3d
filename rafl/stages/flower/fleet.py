"""A Flower deployment on one machine: a SuperLink and SuperNodes on 127.0.0.1, as processes this
module starts and stops (tests, ``bench/flower_overhead.py``, trying ``flwr run`` before a real
fleet). Process management only: how rafl's payloads travel is :mod:`rafl.federation.flower_wire`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rafl.errors import UserInputError
from rafl.stages.flower.supernode import check_poll_interval

#: how often an idle SuperNode of a :class:`LocalFleet` asks its SuperLink for a message, in seconds
POLL_INTERVAL_S = 0.2


@dataclasses.dataclass(frozen=True)
class FleetRun:
    """One ``flwr run`` on a :class:`LocalFleet`, with the outcome Flower keeps for it.

    ``flwr run`` exits 0 whether the ServerApp completed or raised (Flower 1.42), so ``returncode``
    says only that the run was submitted and streamed; ``status`` is the SuperLink's record of the
    run (``flwr ls --run-id ID --format json``): ``finished:completed``, ``finished:failed`` (the
    error in ``status_details``), ... or ``None`` when no run was started (``stdout`` and
    ``stderr`` say why).
    """

    returncode: int
    stdout: str   # `flwr run --stream`: the ServerApp's log
    stderr: str
    run_id: int | None
    status: str | None
    status_details: str

    @property
    def completed(self) -> bool:
        """Whether the ServerApp returned without an exception (``status == "finished:completed"``)."""
        return self.status == "finished:completed"


class LocalFleet:
    """A Flower SuperLink and ``n_nodes`` SuperNodes on 127.0.0.1, for a deployment on one machine
    (tests, ``bench/flower_overhead.py``, trying ``flwr run`` before a real fleet).

    Each process runs in its own session with ``FLWR_HOME = workdir/flwr-home`` and runtime
    dependency installation disabled; node ``i`` has node config ``partition-id=i
    num-partitions=n_nodes``. Leaving the ``with`` block stops them and everything they started
    (their SuperExec and ClientApp processes). Logs: ``workdir/superlink.log``, ``node<i>.log``.

    Args:
        n_nodes: SuperNodes (>= 1).
        workdir: a folder for logs and FLWR_HOME (the SuperLink keeps its state in memory: Flower's
            SQLite state, shared by the SuperLink's threads, timed out on its 5 s lock while the
            nodes' ClientApps kept both cores busy).
        state_dir: the nodes' client-state folder (``RAFL_FLOWER_STATE_DIR``), default
            ``workdir/node-states``.
        isolation: ``"fork"`` (default): each SuperNode runs with ``--isolation process`` beside a
            ``rafl flower-superexec`` (log ``superexec<i>.log``) that forks each message's
            ClientApp from one warm process (:mod:`rafl.stages.flower.superexec`);
            ``"subprocess"``: Flower's own SuperExec, a new ``flwr-clientapp`` process per message.
        poll_interval_s: each SuperNode runs as ``rafl flower-supernode --poll-interval
            poll_interval_s`` (:mod:`rafl.stages.flower.supernode`; default 0.2 s: an idle node asks
            the SuperLink for a message that often); ``None``: Flower's own ``flower-supernode``
            (3 s between an idle node's requests).

    Raises:
        UserInputError: ``n_nodes`` < 1, an unknown ``isolation`` or a bad ``poll_interval_s``.
    """

    ISOLATIONS = ("fork", "subprocess")

    CONNECTION = "rafl-local"

    def __init__(self, n_nodes: int, workdir: str | Path, state_dir: str | Path | None = None,
                 isolation: str = "fork", poll_interval_s: float | None = POLL_INTERVAL_S):
        if n_nodes < 1:
            raise UserInputError(f"is {n_nodes}; allowed: >= 1", field="n_nodes")
        if isolation not in self.ISOLATIONS:
            raise UserInputError(f"is {isolation!r}; allowed: {', '.join(self.ISOLATIONS)}", field="isolation")
        self.isolation = isolation
        self.poll_interval_s = None if poll_interval_s is None else check_poll_interval(poll_interval_s)
        self.n_nodes, self.workdir = n_nodes, Path(workdir)
        self.bindir = Path(sys.executable).parent
        self.home = self.workdir / "flwr-home"
        # this Python's programs first, for the ones the SuperLink and SuperNodes start themselves
        # too (flower-superexec, flwr-serverapp, flwr-clientapp): a venv need not be activated
        path = os.pathsep.join([str(self.bindir), os.environ.get("PATH", "")])
        self.env = {**os.environ, "PATH": path, "FLWR_HOME": str(self.home),
                    "RAFL_FLOWER_STATE_DIR": str(state_dir or self.workdir / "node-states")}
        self.procs: list[Any] = []

    @staticmethod
    def _free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])

    def _program(self, name: str) -> str:
        """``name`` beside this Python, else from PATH."""
        return shutil.which(name, path=self.env["PATH"]) or str(self.bindir / name)

    def _start(self, args: list[str], log: str) -> None:
        with (self.workdir / log).open("w") as fh:
            self.procs.append(subprocess.Popen([self._program(args[0]), *args[1:]], stdout=fh,
                                               stderr=subprocess.STDOUT, env=self.env, start_new_session=True))

    def _wait_for(self, port: int, log: str, timeout: float = 180.0) -> None:
        """Block until 127.0.0.1:``port`` accepts connections (RuntimeError naming ``log`` if the
        process exits or ``timeout`` seconds pass)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.procs[-1].poll() is not None:
                raise RuntimeError(f"{log[:-4]} exited with status {self.procs[-1].returncode}; see "
                                   f"{self.workdir / log}")
            with socket.socket() as sock:
                sock.settimeout(0.5)
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"127.0.0.1:{port} did not open within {timeout:g} s; see {self.workdir / log}")

    def __enter__(self) -> LocalFleet:
        self.home.mkdir(parents=True, exist_ok=True)
        port = self._free_port()
        (self.home / "config.toml").write_text(f'[superlink]\ndefault = "{self.CONNECTION}"\n\n'
                                               f'[superlink.{self.CONNECTION}]\naddress = "127.0.0.1:{port}"\n'
                                               "insecure = true\n")
        try:
            self._start(["flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                         "--disable-runtime-dependency-installation"], "superlink.log")
            self._wait_for(port, "superlink.log")
            for i in range(self.n_nodes):
                runtime_port = self._free_port()
                fork = ["--isolation", "process"] if self.isolation == "fork" else []
                supernode = (["flower-supernode"] if self.poll_interval_s is None else
                             ["rafl", "flower-supernode", "--poll-interval", str(self.poll_interval_s)])
                self._start([*supernode, "--insecure", "--superlink", f"127.0.0.1:{port}", *fork, "--host",
                             "127.0.0.1", "--port", str(runtime_port), "--node-config",
                             f"partition-id={i} num-partitions={self.n_nodes}"], f"node{i}.log")
                if fork:
                    self._start(["rafl", "flower-superexec", "--runtime-api-address", f"127.0.0.1:{runtime_port}",
                                 "--insecure"], f"superexec{i}.log")
        except BaseException:
            self.stop()
            raise
        return self

    def run(self, app_dir: str | Path, timeout: float = 3600, run_config: str | None = None) -> FleetRun:
        """``flwr run APP_DIR rafl-local --stream`` (blocks until the run ends, at most ``timeout``
        seconds: ``subprocess.TimeoutExpired``), then the run's final status from the SuperLink
        (:class:`FleetRun`: check ``.completed``, not the exit status)."""
        extra = ["--run-config", run_config] if run_config else []
        proc = subprocess.run([self._program("flwr"), "run", str(app_dir), self.CONNECTION, "--stream", *extra],
                              capture_output=True, text=True, timeout=timeout, env=self.env, check=False)
        found = re.search(r"Successfully started run (\d+)", proc.stdout)
        run_id = int(found.group(1)) if found else None
        status, details = self.run_status(run_id) if run_id is not None else (None, "")
        return FleetRun(proc.returncode, proc.stdout, proc.stderr, run_id, status, details)

    def run_status(self, run_id: int) -> tuple[str, str]:
        """``(status, status details)`` of run ``run_id`` as the SuperLink records it (``flwr ls
        --run-id ID --format json``), e.g. ``("finished:failed", "ServerApp failed with exception:
        ...")``. Raises RuntimeError when ``flwr ls`` fails or does not know the run."""
        ls = subprocess.run([self._program("flwr"), "ls", self.CONNECTION, "--run-id", str(run_id), "--format",
                             "json"], capture_output=True, text=True, timeout=120, env=self.env, check=False)
        try:
            runs = json.loads(ls.stdout)["runs"]
            row = next(r for r in runs if int(r["run-id"]) == run_id)
        except (ValueError, KeyError, TypeError, StopIteration):
            raise RuntimeError(f"flwr ls --run-id {run_id} (exit status {ls.returncode}) did not list the run: "
                               f"{(ls.stdout + ls.stderr)[-500:]}") from None
        return str(row["status"]), str(row.get("status-details") or "")

    def logs(self) -> str:
        """The SuperLink's and SuperNodes' logs, concatenated."""
        return "".join(f"==> {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.workdir.glob("*.log")))

    def _descendants(self) -> list[int]:
        """Every live process below the ones started here (:func:`descendants`)."""
        return descendants([p.pid for p in self.procs])

    def stop(self) -> None:
        """Stop every process started here and everything below them (:func:`stop_process_trees`)."""
        stop_process_trees(self.procs)
        self.procs = []

    def __exit__(self, *exc: object) -> None:
        self.stop()


def descendants(pids: list[int]) -> list[int]:
    """Every live process below ``pids`` (``ps``: Linux and macOS). The SuperExec starts the
    ServerApp and ClientApps in process groups of their own, so stopping our groups alone can
    leave them behind (a failed run's ServerApp stayed)."""
    try:
        out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    found, todo = [], list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_process_trees(procs: list[Any]) -> None:
    """SIGTERM the process groups of ``procs`` (``subprocess.Popen`` objects started with
    ``start_new_session=True``) and every process below them (SIGKILL after 20 s), and wait
    until they are gone (bounded)."""
    below = descendants([p.pid for p in procs])
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 20  # the groups' other members (SuperExec, ClientApps) end too
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for sig in (signal.SIGTERM, signal.SIGKILL):  # what left our groups (a group of its own, orphaned)
        alive = []
        for pid in below:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        below = alive
        deadline = time.monotonic() + (10 if sig == signal.SIGTERM else 30)
        while below and time.monotonic() < deadline:  # gone, not just signalled: callers check at once
            time.sleep(0.2)
            below = [pid for pid in below if _alive(pid)]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts too) and is not a zombie (an
    ended process its parent has not reaped yet: on Linux, state ``Z`` in ``/proc/PID/stat``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no procfs (macOS): signal 0 is all there is
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


__all__ = ["POLL_INTERVAL_S", "FleetRun", "LocalFleet", "descendants", "stop_process_trees"]
