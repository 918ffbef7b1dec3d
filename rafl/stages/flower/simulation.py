"""Flower's Simulation Runtime (Ray) as ``engine.backend: flower``: :func:`simulate` runs a
prepared federation with every client step a ClientApp on a virtual SuperNode (the ServerApp
logic of :func:`rafl.stages.flower.app.run_on_grid`, the ClientApp of
:mod:`rafl.stages.flower.node`), and tears Ray down promptly on Ctrl-C / SIGTERM
(:func:`_interruptible_ray_backend`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rafl.errors import UserInputError
from rafl.federation.flower_wire import _flwr
from rafl.stages.flower.app import run_on_grid
from rafl.stages.flower.node import _make_client_app, own_node_config


class _Quiet(logging.Filter):
    """Drops Flower's log records (installed on the ``flwr`` logger while an interrupted
    simulation is torn down: the killed ClientApps' errors are the interrupt, not news)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _interruptible_ray_backend(stop: threading.Event, quiet: logging.Filter) -> type:
    """Flower's ``RayBackend`` whose ``terminate`` first ends the ClientApps in progress when the
    Simulation Runtime is being torn down by Ctrl-C / SIGTERM (a ``KeyboardInterrupt`` or
    ``SystemExit`` unwinding the caller's thread), and whose ``init_ray`` keeps the caller's SIGTERM
    handler (``ray.init`` replaces it with one that exits 15 at once, skipping rafl's cleanup).

    Why: Flower (1.42) ends a simulation with ``ray.shutdown()`` while its worker threads may
    still wait in ``ray.get`` for a ClientApp's reply. After a shutdown that ``ray.get`` never
    returns, and the interpreter waits for those (non-daemon) threads at exit: the process hangs
    forever after "Aborted!". Killing the busy actors first makes every pending ``ray.get`` raise
    ``ActorDiedError`` at once; the workers see Flower's stop event and end, and the process
    exits. ``stop`` is set first, so the ServerApp abandons the round instead of counting the
    killed clients as failed, and Flower's log of those errors is muted (``quiet``). A run that
    ends normally or with an error is torn down exactly as by Flower."""
    # ray, flwr: optional (rafl[flower]), and imported after simulate() set Ray's signal switch
    import ray  # noqa: PLC0415
    from flwr.server.superlink.fleet.vce.backend import raybackend  # noqa: PLC0415

    class RayBackend(raybackend.RayBackend):
        def init_ray(self, *args: Any, **kwargs: Any) -> None:
            # ray.init() (in the caller's thread) replaces the caller's SIGTERM handler with one that
            # exits 15 at once; keep the CLI's (it unwinds like Ctrl-C and exits 143)
            main = threading.current_thread() is threading.main_thread()
            previous = signal.getsignal(signal.SIGTERM) if main else None
            super().init_ray(*args, **kwargs)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

        def terminate(self) -> None:
            # Called from Flower's ``finally`` (the caller's thread): sys.exc_info() is what unwinds.
            if isinstance(sys.exc_info()[1], (KeyboardInterrupt, SystemExit)) and self.pool is not None:
                stop.set()
                logging.getLogger("flwr").addFilter(quiet)
                busy = list(dict(getattr(self.pool, "_future_to_actor", {})).items())
                for _, actor in busy:
                    with contextlib.suppress(Exception):  # already dead: nothing to end
                        ray.kill(actor, no_restart=True)
                if busy:  # their ray.get must have returned before ray.shutdown() below
                    ray.wait([f for f, _ in busy], num_returns=len(busy), timeout=10)
            super().terminate()

    return RayBackend


def simulate(prep: Any, run_dir: Path, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``prep`` on Flower's Simulation Runtime (Ray): ``engine.supernodes`` virtual SuperNodes
    (default one per client), one CPU per ClientApp.

    Ctrl-C abandons the round in progress (the last complete round stays checkpointed), ends the
    ClientApps in progress and shuts Ray down, then unwinds as in-process (the CLI exits with 130
    within seconds).

    Raises:
        UserInputError: ``engine.supernodes`` above the number of clients (before Ray starts),
            anything the run raises (re-raised from the ServerApp), or a run that ended without a
            summary (the Simulation Runtime's own failure)."""
    n_clients = len(prep.federation.clients)
    n_nodes = prep.cfg.engine.supernodes or n_clients
    if n_nodes > n_clients:  # virtual node I hosts clients I, I+P, ...: those beyond the clients would idle
        raise UserInputError(f"is {n_nodes} but the run has {n_clients} clients; allowed: 1..{n_clients} (virtual "
                             "SuperNode I hosts clients I, I+P, I+2P, ...), or null for one per client",
                             field="engine.supernodes")
    # Ray's driver installs abseil's failure-signal handler, which takes SIGTERM over: it prints a
    # stack dump and aborts the process (exit 134) after rafl's handler has run, instead of the
    # 143 every other backend exits with. rafl handles the signals itself. Ray reads the switch
    # once, when it is first imported: set it before Flower imports Ray.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    _flwr()  # a clear error without rafl[flower]
    # flwr, ray: optional, and Ray reads the switch above when Flower first imports it
    from flwr.serverapp import ServerApp  # noqa: PLC0415
    from flwr.simulation import run_simulation  # noqa: PLC0415

    try:
        from flwr.server.superlink.fleet.vce.backend import raybackend  # noqa: PLC0415
    except ImportError:  # pragma: no cover - no ray: run_simulation says what to install
        raybackend = None

    out: dict[str, Any] = {}
    stop = threading.Event()
    sapp = ServerApp()

    @sapp.main()
    def _main(grid: Any, context: Any) -> None:
        try:
            out["summary"] = run_on_grid(grid, prep, run_dir, resume=resume, progress=progress, shared_disk=True,
                                         stop=stop)
        except BaseException as err:  # re-raised in the caller's thread below
            out["error"] = err

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # the virtual nodes are this process's own: they allow what this run config names and its run
    # dir's clients/ (rafl.stages.flower.node.NodeTrust); the settings travel with the ClientApp to Ray's workers
    client_app = _make_client_app(own_node_config(prep.cfg, Path(run_dir) / "clients"))
    quiet = _Quiet()
    before = set(threading.enumerate())
    flwr_backend = getattr(raybackend, "RayBackend", None)  # the Simulation Runtime looks it up here when it starts
    if flwr_backend is not None:
        raybackend.RayBackend = _interruptible_ray_backend(stop, quiet)
    try:
        run_simulation(sapp, client_app, num_supernodes=n_nodes, backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": max(1, min(os.cpu_count() or 1, n_nodes)), "include_dashboard": False,
                          "log_to_driver": False}})
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C / SIGTERM: the ServerApp abandons the round in progress
        stop.set()
        deadline = time.monotonic() + 10  # Flower's threads end now (see _interruptible_ray_backend)
        for th in set(threading.enumerate()) - before:
            if not th.daemon:
                th.join(max(0.0, deadline - time.monotonic()))
        raise
    finally:
        stop.set()
        if flwr_backend is not None:
            raybackend.RayBackend = flwr_backend
        logging.getLogger("flwr").removeFilter(quiet)
    if "error" in out:
        raise out["error"]
    if "summary" not in out:
        raise UserInputError("the Flower Simulation Runtime ended without finishing the run (see its log above)",
                             field="engine.backend")
    return out["summary"]


__all__ = ["simulate"]
