"""A SuperExec for rafl's SuperNodes that forks each ClientApp process from one warm process.

Flower runs every message a SuperNode receives in a new ClientApp process (``flwr-clientapp``,
:func:`flwr.supernode.runtime.run_clientapp.run_clientapp`: it pulls one message, runs it, pushes
the reply and exits), launched by a SuperExec. Flower's own SuperExec starts that process with
``subprocess.Popen``, so each message pays a Python start, the torch and flwr imports and the
rebuild of the run's federation (data, partition, supernet, subnets): seconds per message, most of
a round on small models.

:func:`run` is a SuperExec for a SuperNode started with ``--isolation process``: one process that
imports torch, flwr and rafl once and then, for each ClientApp task the SuperNode has, forks a
child that runs Flower's :func:`run_clientapp` itself (same token, same Runtime API, same one
message). The child inherits the imports and every run's federation this process has built, so a
message costs the fork plus the clients' own work and the transfers.

The federation cache (:func:`rafl.federation.flower_node.warm`): a child that meets a run config
this process has not built yet reports the config text on a pipe once the node's trust rules
(:class:`~rafl.federation.flower_node.NodeTrust`, with the node config the message came with)
accepted it; this process then builds that federation too (one run at a time), and later children
start with it. What a child may load is what the node's own config allows: the report carries no
more than the message did, and the build here is the same code the child runs.

Children run one torch thread unless the run config asks for more (``train.threads``); this
process itself never starts torch's thread pool (``torch.set_num_threads(1)`` before any work), so
a forked child does not inherit a pool whose threads it lacks.

Needs ``fork`` (Linux, macOS). Started by :class:`~rafl.stages.flower.fleet.LocalFleet` beside
each SuperNode, or by hand: ``rafl flower-superexec --runtime-api-address 127.0.0.1:9094 --insecure``.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rafl.errors import UserInputError
from rafl.stages.flower import app  # noqa: F401 - the ClientApp and everything it imports, once, before the forks
from rafl.stages.flower import node as flower_node

#: how often this process asks the SuperNode for a new task, in seconds (Flower's default is 1 s):
#: each message waits for at most one poll, and each poll is a request the SuperNode serves, on the
#: cores its ClientApps need (0.02 s cost more round time in CPU than it saved in waiting)
POLL_INTERVAL_S = 0.1
#: the environment variable Flower's SuperExec loop reads its poll interval from
_POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"


@dataclass
class ForkExecutor:
    """Flower's ``Executor`` protocol (``flwr.supercore.superexec.executor.types``) for ClientApp
    tasks: :meth:`launch` forks a child that runs Flower's ``run_clientapp`` with the task's
    token; :meth:`reconcile` (called by Flower's loop before each poll) reaps finished children and
    hands the run configs they reported to ``warm``.

    Args:
        warm: called in this process with each new run config text a child reported (builds its
            federation, :func:`rafl.federation.flower_node.warm`); an exception it raises is
            logged and the run stays cold (children build it themselves).
    """

    warm: Callable[[str], None]
    children: dict[int, int] = field(default_factory=dict)  # pid -> read end of its report pipe
    pending: dict[int, bytearray] = field(default_factory=dict)

    def get_eligible_capacity(self, supported_task_types: set[Any], *, insecure: bool = False,
                              root_certificates_path: str | None = None) -> tuple[set[Any], set[str]]:
        """Only ClientApp tasks (a SuperNode's); no capacity limit."""
        from flwr.supercore.constant import TaskType  # noqa: PLC0415 - flwr: optional (rafl[flower])

        del insecure, root_certificates_path
        return {t for t in supported_task_types if t == TaskType.CLIENT_APP}, set()

    def wait_for_capacity(self, task_type: Any = None, *, fab_hash: str | None = None, insecure: bool = False,
                          root_certificates_path: str | None = None) -> None:
        """No capacity gate: returns at once."""
        del task_type, fab_hash, insecure, root_certificates_path

    def launch(self, spec: Any) -> Any:
        """Fork a child that runs the task ``spec`` (an ``ExecutionSpec``) with Flower's
        ``run_clientapp``; returns ``LaunchResult.accepted()`` (``failed`` when fork fails)."""
        from flwr.supercore.superexec.executor import LaunchResult  # noqa: PLC0415 - as above

        read_end, write_end = os.pipe()
        try:
            pid = os.fork()
        except OSError as err:
            os.close(read_end)
            os.close(write_end)
            return LaunchResult.failed(f"fork failed: {err}")
        if pid == 0:  # the child: never returns
            os.close(read_end)
            _child(spec, write_end)
        os.close(write_end)
        os.set_blocking(read_end, False)
        self.children[pid] = read_end
        self.pending[pid] = bytearray()
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Warm the runs the children reported (as soon as a report is whole: this process builds
        while the child does), and reap the children that exited."""
        for pid, fd in list(self.children.items()):
            self._read(fd, self.pending[pid])
            for text in _take_messages(self.pending[pid]):
                t0 = time.perf_counter()
                try:
                    self.warm(text)
                    print(f"rafl flower-superexec: built run config {flower_node.config_key(text)[:12]} "
                          f"here in {time.perf_counter() - t0:.1f} s; later messages start with it",
                          file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a run that fails to build here stays cold
                    print("rafl flower-superexec: could not build a reported run here; its messages "
                          "build it themselves:\n" + traceback.format_exc(), file=sys.stderr, flush=True)
            if os.waitpid(pid, os.WNOHANG)[0]:
                os.close(fd)
                del self.children[pid], self.pending[pid]

    @staticmethod
    def _read(fd: int, into: bytearray) -> None:
        while select.select([fd], [], [], 0)[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            into += chunk

    def close(self) -> None:
        """Stop the children still running (SIGTERM: Flower's handler in each pushes its status)."""
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _take_messages(buffer: bytearray) -> list[str]:
    """The whole texts at the start of ``buffer`` (each written by :func:`_reporter`: an 8-digit
    length, then UTF-8 text), removed from it; a partial one stays."""
    out = []
    while len(buffer) >= 8 and len(buffer) >= 8 + int(buffer[:8]):
        n = int(buffer[:8])
        out.append(bytes(buffer[8:8 + n]).decode())
        del buffer[:8 + n]
    return out


def _reporter(fd: int) -> Callable[[str], None]:
    def report(text: str) -> None:
        data = text.encode()
        os.write(fd, f"{len(data):08d}".encode() + data)  # a pipe buffers 64 KiB: a run config fits
    return report


def _child(spec: Any, report_fd: int) -> None:
    """Run one ClientApp task in this forked child and exit with its status (never returns)."""
    code = 1
    try:
        # flwr: optional (rafl[flower]); run_clientapp looked up here, where a test replaces it
        from flwr.supercore.tls import validate_and_resolve_root_certificates  # noqa: PLC0415
        from flwr.supernode.runtime.run_clientapp import run_clientapp  # noqa: PLC0415

        for sig in (signal.SIGINT, signal.SIGTERM):  # the parent's handlers stop the parent's loop
            signal.signal(sig, signal.SIG_DFL)
        flower_node.on_new_run = _reporter(report_fd)
        run_clientapp(runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
                      certificates=validate_and_resolve_root_certificates(spec.root_certificates_path,
                                                                          spec.insecure),
                      parent_pid=None, runtime_dependency_install=spec.runtime_dependency_install)
        code = 0
    except SystemExit as err:  # run_clientapp ends with flwr_exit (sys.exit with Flower's exit code)
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child reports and exits, never returns into the parent's loop
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(runtime_api_address: str, *, insecure: bool, root_certificates: str | None = None,
        parent_pid: int | None = None, superexec_auth_secret_file: str | None = None) -> None:
    """Serve the SuperNode's ClientApp tasks at ``runtime_api_address`` (host:port of the
    SuperNode's Runtime API, its ``--host``/``--port``) until SIGINT/SIGTERM, with Flower's own
    SuperExec loop (``flwr.supercore.superexec.run_superexec``) and a :class:`ForkExecutor`.

    Args:
        insecure: no TLS to the Runtime API (a SuperNode on the same machine); else
            ``root_certificates`` is the CA file (PEM) that signed the SuperNode's Runtime API
            certificate (its ``--ssl-*`` options).
        parent_pid: stop when this process exits (as ``flower-superexec --parent-pid``).
        superexec_auth_secret_file: the SuperNode's ``--superexec-auth-secret-file``, if set.

    Raises:
        UserInputError: this platform cannot fork.
    """
    if "fork" not in multiprocessing.get_all_start_methods():
        raise UserInputError("needs fork (Linux, macOS); use Flower's subprocess isolation on this platform",
                             field="rafl flower-superexec")
    torch.set_num_threads(1)  # see the module docstring: no thread pool for the children to inherit
    import flwr.supercore.superexec.run_superexec as superexec  # noqa: PLC0415 - flwr: optional (rafl[flower])
    from flwr.supercore.auth import load_superexec_auth_secret  # noqa: PLC0415

    executor = ForkExecutor(warm=flower_node.warm)
    # flwr 1.42 builds its executor from a type name (subprocess, kubernetes) and takes no instance:
    # the loop's one factory call is pointed at this executor; the rest of the loop is Flower's own
    superexec.get_executor = lambda *args, **kwargs: executor
    os.environ.setdefault(_POLL_ENV, str(POLL_INTERVAL_S))
    secret = load_superexec_auth_secret(secret_file=superexec_auth_secret_file) if superexec_auth_secret_file else None
    superexec.run_superexec(runtime_api_address=runtime_api_address, insecure=insecure,
                            root_certificates_path=root_certificates, superexec_auth_secret=secret,
                            parent_pid=parent_pid, runtime_dependency_install=False)
