"""The Flower App: a ServerApp and a ClientApp for a real SuperLink and its SuperNodes (``flwr
run``; the run config keys are ``config``, ``out``, ``resume`` and ``rounds``), written into a
folder by ``rafl flower-app``.

The ServerApp runs the same stage as ``rafl federate``: it prepares the run config
(:func:`rafl.stages.prepare.prepare`), claims the run dir (:class:`rafl.stages.rundir.RunDir`) and
runs the engine with :class:`rafl.federation.flower_runner.FlowerClients` as its client runner
(:func:`run_on_grid`, also the Simulation Runtime's server side). The ClientApp is
:mod:`rafl.stages.flower.node`'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import yaml

from rafl import __version__
from rafl.errors import UserInputError
from rafl.federation.checks import deployment_of
from rafl.federation.engine import Federation
from rafl.federation.flower_runner import FlowerClients, Stopped, discover_nodes, warm_nodes
from rafl.federation.flower_wire import one_line, whole_number
from rafl.federation.metric_keys import MODEL
from rafl.federation.run_config import load_run_config
from rafl.federation.store import ClientStore
from rafl.folders import RunFolder, check_creatable
from rafl.io import atomic_write_text
from rafl.stages.checks import FEDERATE_RUN
from rafl.stages.flower.node import _make_client_app
from rafl.stages.prepare import prepare
from rafl.stages.rundir import RunDir, default_name, resumed_config
from rafl.stages.runs import run_prepared

#: the Flower App's run dir: a ``rafl federate`` run dir (:data:`~rafl.stages.checks.FEDERATE_RUN`)
#: whose errors name the run config's keys; one whose run never completed a round is refused (its
#: nodes may still hold that run's client states), not taken over
FLOWER_RUN = dataclasses.replace(
    FEDERATE_RUN,
    foreign="already exists and is not a rafl run dir; set another name (run YAML) or out (run config)",
    taken="already exists; continue it with --run-config \"resume='{path}'\", or set another name (run YAML) or "
          "out (run config)",
    dead="already exists and its run never completed a round (nothing to resume); remove it, or set another name "
         "(run YAML) or out (run config)")


def run_key_of(run_dir: Path, resolved: dict[str, Any]) -> str:
    """A short stable key naming a run's client-state folder on the nodes: the run dir and its
    resolved config (:meth:`RunConfig.resolved`) without the ``engine`` section, the settings a
    resume may change (``engine.rounds`` to extend a run, ``engine.backend``, timeouts); the key
    used to include them, so a run extended with more rounds looked in an empty folder."""
    text = yaml.safe_dump({k: v for k, v in resolved.items() if k != "engine"}, sort_keys=True)
    return hashlib.sha256(f"{Path(run_dir).resolve()}\n{text}".encode()).hexdigest()[:16]


def run_on_grid(grid: Any, prep: Any, run_dir: Path, *, resume: bool = False, progress: bool = True,
                shared_disk: bool = False, stop: threading.Event | None = None) -> dict[str, Any]:
    """Run a prepared federation (:func:`rafl.stages.prepare.prepare`) with its client steps
    on the grid's SuperNodes; the rest as :func:`rafl.stages.runs.run_prepared` (same run dir).
    ``shared_disk``: the nodes run on this machine (simulation) and keep client states in the
    run dir's ``clients/``. ``stop``: set it to abandon the run (:class:`Stopped`); the last
    checkpoint stays the last complete round."""
    if prep.cfg.engine.backend != "flower":  # what the run dir's config.yaml records: it runs on Flower
        cfg = prep.cfg.model_copy(update={"engine": prep.cfg.engine.model_copy(update={"backend": "flower"})})
        prep = dataclasses.replace(prep, cfg=cfg)
    cfg = prep.cfg
    config_text = yaml.safe_dump(cfg.resolved(), sort_keys=True)
    timeout = float(cfg.engine.round_timeout_s)
    node_of = discover_nodes(grid, len(prep.federation.clients), max(timeout, 60.0), simulation=shared_disk, stop=stop)
    if not shared_disk:  # SuperNodes build the run's federation now, not in round 1 (warm_nodes)
        warm_nodes(grid, sorted(set(node_of.values())), config_text, timeout, stop)
    key = run_key_of(run_dir, cfg.resolved())
    # on a SuperLink the nodes keep the client states on their own disks: the run dir says so
    # (clients.json), and only the Flower App resumes it (rafl federate --resume refuses it)
    deployment = None if shared_disk else {
        "backend": "flower", "runtime": "superlink",
        "client_states": f"on every SuperNode's disk, in <state-dir>/{key}/ (default ~/.cache/rafl/flower-states/{key}/)"}

    made: list[FlowerClients] = []

    def runner(fed: Federation, store: ClientStore, seed: int) -> FlowerClients:
        made.append(FlowerClients(fed, store, seed, grid=grid, node_of=node_of, config_text=config_text, run_key=key,
                             timeout=timeout, state_dir=str(Path(run_dir).resolve() / "clients") if shared_disk else "",
                             stop=stop, simulation=shared_disk))
        return made[-1]

    try:
        summary = run_prepared(prep, run_dir, resume=resume, progress=progress, clients=runner,
                               backend="flower-simulation" if shared_disk else "flower-superlink", deployment=deployment)
    except BaseException as err:
        if made and not resume and not shared_disk and not (Path(run_dir) / "checkpoint.safetensors").is_file():
            # no round completed: the nodes' states of this run can never be resumed. After an error
            # the nodes get the round timeout to confirm (a loaded node starts a ClientApp process
            # slowly); after an interrupt 10 s, the user is waiting
            interrupted = isinstance(err, (Stopped, KeyboardInterrupt, SystemExit))
            try:
                lost = made[-1].discard(10.0 if interrupted else made[-1].timeout)
            except Exception as why:  # noqa: BLE001 - best effort; the run's own error is the news
                lost = {"all nodes": one_line(str(why))}
            if lost:
                print("rafl: the run failed before its first complete round; "
                      + "; ".join(f"node {nid} did not delete its client states ({why})" for nid, why in lost.items())
                      + f": delete <state-dir>/{key}/ on them by hand", flush=True)
            else:
                print(f"rafl: the run failed before its first complete round; the nodes deleted its client states "
                      f"(<state-dir>/{key}/)", flush=True)
        raise
    made[-1].finish()
    return summary


# ---------------------------------------------------------------------- entry points
APP_PYPROJECT = """\
# A Flower App that runs rafl's federation on a SuperLink and its SuperNodes (written by
# `rafl flower-app`). Run it with `flwr run <this folder> <superlink connection>`.
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "rafl-flower-app"
version = "{version}"
description = "rafl: resource-aware heterogeneous federated learning on Flower"
license = "Apache-2.0"
dependencies = ["rafl[flower]"]

[tool.flwr.app]
publisher = "rafl"

[tool.flwr.app.components]
serverapp = "rafl.stages.flower.app:server_app"
clientapp = "rafl.stages.flower.app:client_app"

[tool.flwr.app.config]
# absolute paths on the SuperLink's machine (the ServerApp does not run in your shell's folder)
config = {config}   # a rafl run config (YAML, as for `rafl federate --config`); "" = the defaults
out = {out}         # run dirs are created under this folder
resume = ""           # a run dir to continue from its last complete round instead
rounds = 0            # > 0 sets engine.rounds (e.g. more rounds for a resumed run)
"""


def _absolute(value: Any, key: str) -> Path | None:
    """``run_config.<key>``: an absolute path, or None for a missing key or ``""``.

    Raises:
        UserInputError: a value that is not text (``resume=0`` used to mean no resume) or a
            relative path."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise UserInputError(f"is {value!r}; allowed: an absolute path in quotes (--run-config \"{key}='/...'\"), "
                             "or \"\"", field=f"run_config.{key}")
    text = value
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise UserInputError(f"is {text!r}; allowed: an absolute path (the ServerApp runs in the SuperLink's "
                             "process, not in your shell's folder)", field=f"run_config.{key}")
    return path


def _run_config_rounds(value: Any) -> int:
    """``run_config.rounds``: 0 (keep the config's ``engine.rounds``) or an integer >= 1
    (:func:`whole_number`).

    Raises:
        UserInputError: anything else (``-1`` used to be ignored, ``2.7`` to become 2 and ``'abc'``
            to raise a bare ``ValueError``)."""
    rounds = whole_number(value)
    if rounds is None or rounds < 0:
        raise UserInputError(f"is {value!r}; allowed: 0 (the config's engine.rounds) or an integer >= 1",
                             field="run_config.rounds")
    return rounds


def _load_from_run_config(run_config: dict[str, Any]) -> tuple[Any, Path, bool]:
    """``(prepared, run_dir, resume)`` from a ``flwr run`` run config (keys ``config``: path of
    the rafl run YAML on the SuperLink's machine, ``out``: run dir parent, ``resume``: a run dir,
    ``rounds``: > 0 sets ``engine.rounds`` (e.g. to extend a resumed run); absolute paths).
    Relative paths inside the YAML are taken relative to its folder.

    Raises:
        UserInputError: a relative path, a missing file, a run dir that exists (not resuming), a
            ``rounds`` below the completed rounds, or an invalid run config."""
    rounds = _run_config_rounds(run_config.get("rounds", 0))
    # the run dir's config.yaml records the backend it ran on (a resume rewrites it)
    overrides = ["engine.backend=flower"] + ([f"engine.rounds={rounds}"] if rounds > 0 else [])
    resume = _absolute(run_config.get("resume"), "resume")
    if resume is not None:
        if not (resume / "checkpoint.safetensors").is_file():
            raise UserInputError("is not a rafl run dir with a checkpoint (nothing to resume)", source=resume,
                                 field="run_config.resume")
        if deployment_of(resume) is None and any((resume / "clients").glob("*.st")):
            raise UserInputError("ran in-process or on the Simulation Runtime: its client states are in its clients/ "
                                 "folder, which SuperNodes do not read; resume it with: rafl federate --resume "
                                 f"{resume}", source=resume, field="run_config.resume")
        cfg = resumed_config(resume, overrides, rounds_field="run_config.rounds")
        return prepare(cfg, progress=False), resume, True  # its config.yaml: rewritten once it succeeds
    config = _absolute(run_config.get("config"), "config")
    cfg = load_run_config(config, overrides)  # relative paths inside: against the YAML's folder
    out = _absolute(run_config.get("out"), "out")
    if out is None:
        raise UserInputError("is empty; allowed: an absolute folder for run dirs", field="run_config.out")
    check_creatable(out, "run_config.out")  # a file, or a folder nothing can be created in: before any work
    run_dir = out / (cfg.name or default_name(cfg))
    RunFolder.check_new(run_dir, FLOWER_RUN, "run_config.out")  # claimed (RunDir.claim) once prepared
    return prepare(cfg, progress=False), run_dir, False


def write_app(folder: str | Path, *, config: str | Path | None = None, out: str | Path = "runs") -> Path:
    """Write the Flower App (``pyproject.toml`` naming this module's ``server_app`` and
    ``client_app``) into ``folder``; ``config``/``out`` become the run config's defaults
    (made absolute). Returns the ``pyproject.toml`` path.

    Raises:
        UserInputError: ``folder`` holds a pyproject.toml already."""
    folder = Path(folder)
    target = folder / "pyproject.toml"
    if target.exists():
        raise UserInputError("already holds a pyproject.toml (choose an empty folder)", source=folder, field="--out")
    folder.mkdir(parents=True, exist_ok=True)
    quoted = json.dumps  # a JSON string is a TOML basic string (backslashes of Windows paths escaped)
    text = APP_PYPROJECT.format(version=__version__, config=quoted(str(Path(config).resolve()) if config else ""),
                                out=quoted(str(Path(out).resolve())))
    atomic_write_text(target, text)
    return target


def _make_server_app() -> Any:
    from flwr.serverapp import ServerApp  # noqa: PLC0415 - flwr: optional (rafl[flower])

    sapp = ServerApp()

    @sapp.main()
    def _main(grid: Any, context: Any) -> None:
        try:
            prep, run_dir, resume = _load_from_run_config(dict(context.run_config))
            key = run_key_of(run_dir, prep.cfg.resolved())
            print(f"rafl: run dir {run_dir}; the nodes keep its client states in <state-dir>/{key}/ (default "
                  f"~/.cache/rafl/flower-states/{key}/: delete it when the run is no longer needed)", flush=True)
            # held while the run writes; removed when it fails before its first complete round
            with (RunDir.resume(run_dir, field="run_config.resume", here=False) if resume else
                  RunDir.claim(run_dir.parent, run_dir.name, default=run_dir.name, field="run_config.out",
                               kind=FLOWER_RUN)) as rd:
                summary = run_on_grid(grid, prep, run_dir, resume=resume, progress=False)
                if resume:  # with its new engine.rounds, as `rafl federate --resume` (not when it failed)
                    rd.write_config(prep.cfg)
        except BaseException as err:
            if isinstance(err, UserInputError):  # one line first in the run's log; the run ends as failed
                print(f"error: {err}", flush=True)
            raise  # Flower logs the traceback after it (a SystemExit here would lose the streamed line)
        final = summary["final"]
        print(f"rafl: {summary['rounds']} rounds; model accuracy: mean over clients "
              f"{final.get(MODEL.acc_mean_over_clients, float('nan')):.3f}, sample-weighted "
              f"{final.get(MODEL.acc_sample_weighted, float('nan')):.3f}; {summary['cum_mb']:.2f} MB; "
              f"run dir {run_dir}", flush=True)

    return sapp

try:  # the Flower App's components (``flwr run`` finds them by name); rafl itself imports without flwr
    client_app = _make_client_app()
    server_app = _make_server_app()
except ImportError:  # pragma: no cover - depends on the environment
    client_app = server_app = None


__all__ = ["client_app", "run_key_of", "run_on_grid", "server_app", "write_app"]
