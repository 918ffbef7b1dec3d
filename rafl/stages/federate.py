"""``rafl federate``: a new run (:func:`start`) or a continued one (:func:`resume`), end to end.

Each resolves the run config, claims the run dir (:class:`~rafl.stages.rundir.RunDir`), prepares
the federation (:func:`~rafl.stages.prepare.prepare`: every check before anything is written) and
runs it (:func:`run`), which picks the client runner: the engine's own (this process, or
``engine.workers`` forked processes), or Flower's Simulation Runtime with ``engine.backend:
flower`` (:func:`rafl.stages.flower.simulation.simulate`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rafl.config import RunConfig
from rafl.stages.prepare import Prepared, prepare
from rafl.stages.rundir import RunDir, default_name
from rafl.stages.runs import run_prepared

#: what an interrupted new run says when it completed no round (its run dir is gone)
NOTHING_KEPT = "interrupted before the first complete round: nothing was kept"


def run(prep: Prepared, run_dir: str | Path, *, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run ``prep`` in ``run_dir`` on the runner its ``engine.backend`` names; returns the summary
    (:func:`rafl.stages.runs.run_prepared`)."""
    if prep.cfg.engine.backend == "flower":
        # flwr (grpc, cryptography, protobuf: ~30 MB resident) is loaded only for the Flower backend
        from rafl.stages.flower.simulation import simulate  # noqa: PLC0415

        return simulate(prep, Path(run_dir), resume=resume, progress=progress)
    return run_prepared(prep, run_dir, resume=resume, progress=progress)


def start(cfg: RunConfig, out: str | Path, *, progress: bool = True) -> tuple[dict[str, Any], Path]:
    """A new run of ``cfg`` in ``out/<cfg.name>`` (default name: :func:`rafl.stages.rundir.default_name`).

    Returns:
        ``(summary, run_dir)``.

    Raises:
        UserInputError: the run dir cannot be claimed, or whatever :func:`prepare` refuses; the
            run dir is then removed (nothing half-made).
        KeyboardInterrupt / SystemExit: Ctrl-C or SIGTERM, after one line on stderr says what was
            kept (:meth:`RunDir.how_to_resume`, or :data:`NOTHING_KEPT`)."""
    with RunDir.claim(out, cfg.name, default=default_name(cfg)) as rd:
        try:
            prep = prepare(cfg, progress=progress)  # every check happens here; the run dir is still empty
            summary = run(prep, rd.path, progress=progress)
        except (KeyboardInterrupt, SystemExit):
            rd.discard_if_incomplete()
            print(rd.how_to_resume() or NOTHING_KEPT, file=sys.stderr, flush=True)
            raise
        return summary, rd.path


def resume(run_dir: str | Path, overrides: tuple[str, ...] | list[str] = (), *,
           progress: bool = True) -> tuple[dict[str, Any], Path]:
    """Continue ``run_dir`` from its last complete round; ``overrides`` may change only the
    ``engine`` section (:meth:`RunDir.resumed_config`). The run dir's ``config.yaml`` is rewritten
    (atomically) once the run succeeds.

    Returns:
        ``(summary, run_dir)``.

    Raises:
        UserInputError: ``run_dir`` cannot be resumed here (:meth:`RunDir.resume`), or a refused
            override.
        KeyboardInterrupt / SystemExit: Ctrl-C or SIGTERM, after one line on stderr names the
            rounds checkpointed and the command that continues."""
    with RunDir.resume(run_dir) as rd:
        # paths in a run dir's config.yaml are absolute (rafl.config.absolute_paths); in an older
        # one a relative path meant the current folder
        cfg = rd.resumed_config(overrides, base=Path.cwd())
        prep = prepare(cfg, progress=progress)
        try:
            summary = run(prep, rd.path, resume=True, progress=progress)
        except (KeyboardInterrupt, SystemExit):
            line = rd.how_to_resume()
            if line:
                print(line, file=sys.stderr, flush=True)
            raise
        rd.write_config(cfg)
        return summary, rd.path


__all__ = ["NOTHING_KEPT", "prepare", "resume", "run", "start"]
