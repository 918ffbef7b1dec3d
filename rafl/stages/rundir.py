"""A run dir's lifecycle, in one place for every stage that writes one (``rafl federate``, the
Flower App's ServerApp, ``rafl compare``'s per-method runs).

A run dir is a run folder (:mod:`rafl.folders`, kind "run": its checks, lock and cleanup on
failure are there): created and claimed (:meth:`RunDir.claim`) or opened to continue
(:meth:`RunDir.resume`); while a stage holds it, an exclusive ``flock`` on the folder tells a live
run's folder from a dead one's (the kernel releases it on ``kill -9``). A run that fails or is
interrupted before its first complete round leaves nothing (:meth:`RunDir.discard_if_incomplete`);
a resumed run rewrites its ``config.yaml`` atomically once it succeeds (:meth:`RunDir.write_config`);
what a resume may change is checked in one place (:func:`resumed_config`).
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

from rafl.config import RunConfig, parse_overrides
from rafl.errors import UserInputError, shown
from rafl.federation.checks import (
    check_checkpoint_readable,
    check_resumable_here,
    check_resume_rounds,
    completed_rounds,
)
from rafl.federation.run_config import load_run_config
from rafl.federation.run_files import CHECKPOINT
from rafl.folders import RunFolder, RunKind, check_creatable
from rafl.io import atomic_write_yaml
from rafl.stages.checks import CONFIG, FEDERATE_RUN, check_resume_dir, is_compare_folder


def default_name(cfg: Any) -> str:
    """``<algorithm>-<dataset>-<YYYYmmdd-HHMMSS>``: a run's name when its config sets none."""
    return f"{cfg.algorithm.name}-{cfg.data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"


def resumed_config(run_dir: str | Path, overrides: tuple[str, ...] | list[str] = (), *,
                   rounds_field: str = "engine.rounds", base: Path | None = None) -> RunConfig:
    """``run_dir``'s ``config.yaml`` with ``overrides`` (``KEY=VALUE``), of which a resume may
    change only the ``engine`` section (more ``engine.rounds`` to extend the run,
    ``engine.backend``, timeouts): every other section decides the clients' data, models and
    seeds. ``base``: the folder relative paths of an older config mean (paths in a run dir's
    ``config.yaml`` are absolute; default: the file's folder).

    Raises:
        UserInputError: an override outside ``engine`` (``field`` ``--set``), a value the run
            config refuses, or ``engine.rounds`` below the completed rounds (``rounds_field``)."""
    cfg_file = Path(run_dir) / CONFIG
    fixed = sorted({key for key, _ in parse_overrides(overrides) if key.split(".")[0] != "engine"})
    if fixed:  # before the values are read: e.g. another algorithm.name would fail on the run's hparams
        raise UserInputError(f"--resume may change only engine settings (engine.rounds to extend the run, "
                             f"engine.backend, ...), not {fixed}", field="--set")
    old = load_run_config(cfg_file, base=base)
    try:
        cfg = load_run_config(cfg_file, overrides, base=base)
    except UserInputError as err:  # the file alone is valid, so an override is at fault
        raise UserInputError(err.message, source="--set", field=err.field) from None
    changed = {k for k in ("data", "partition", "clients", "supernet", "search", "algorithm", "train", "seed")
               if getattr(cfg, k) != getattr(old, k)}
    if changed:
        raise UserInputError(f"--resume may change only engine settings, not {sorted(changed)}", field="--set")
    check_resume_rounds(run_dir, cfg.engine.rounds, rounds_field)
    return cfg


class RunDir(RunFolder):
    """A ``rafl federate`` run dir held by this process (a :class:`rafl.folders.RunFolder` of
    :data:`~rafl.stages.checks.FEDERATE_RUN`, or of another kind of the same files): its path,
    whether it continues an earlier run, and the lock on it (held until :meth:`close`; a ``with``
    block closes it and, on an exception, first :meth:`discard_if_incomplete`).

    Attributes:
        path: the run dir.
        resumed: it continues a run that completed at least one round.
    """

    # ------------------------------------------------------------------ opening
    @classmethod
    def claim(cls, out: str | Path, name: str | None, *, default: str, field: str = "name",
              kind: RunKind = FEDERATE_RUN) -> RunDir:
        """Create and claim the run dir ``out/name`` for a new run.

        ``name`` None: ``out/default``, or ``default-2``, ``-3``, ... when runs started in the same
        second (a sweep) took it (:meth:`RunFolder.start_unique`), so parallel runs never share (or
        clean up) one run dir. A named run dir is checked by ``kind``'s rules
        (:meth:`RunFolder.start`): with :data:`~rafl.stages.checks.FEDERATE_RUN`, one that never
        completed a round (its run was killed before the first checkpoint, and no live run holds
        its lock) is emptied and reused, with a warning.

        Raises:
            UserInputError: ``out`` cannot be created or written; ``name`` is not a plain folder
                name; the run dir holds something that is not a run dir, a run that completed a
                round (resume it instead), one ``kind`` refuses, or is held by a live run
                (``field`` names the setting)."""
        out = Path(out)
        check_creatable(out)  # a file, or a folder nothing can be created in: before any work
        if name is not None and (Path(name).name != name or name in (".", "..")):
            raise UserInputError(f"is {shown(name)}; allowed: a plain folder name (no '/' or '..'), created under "
                                 "--out", field=field)
        if name is None:
            return cls.start_unique(out, default, kind, field=field)
        return cls.start(out / name, kind, field=field)

    @classmethod
    def resume(cls, path: str | Path, *, field: str = "--resume", here: bool = True) -> RunDir:
        """Open the run dir ``path`` to continue it from its last complete round, and claim it.

        ``here``: the client states must be in the run dir (this process, worker processes or the
        Simulation Runtime); False for a Flower App on a SuperLink, whose nodes hold them.

        Raises:
            UserInputError: ``path`` does not exist, is not a run dir, is a ``rafl compare``
                folder (naming the command that continues it), never completed a round, has a
                checkpoint cut short, ran on a SuperLink (``here``), or is held by a live run."""
        path = check_resume_dir(path, field)
        if here:
            check_resumable_here(path)  # a SuperLink's run: its client states are on the nodes
        check_checkpoint_readable(path)  # cut short by a copy: say how to recover, before any work
        return cls.reopen(path, FEDERATE_RUN, field=field)

    def resumed_config(self, overrides: tuple[str, ...] | list[str] = (), *, rounds_field: str = "engine.rounds",
                       base: Path | None = None) -> RunConfig:
        """:func:`resumed_config` of this run dir."""
        return resumed_config(self.path, overrides, rounds_field=rounds_field, base=base)

    # ------------------------------------------------------------------ state
    @property
    def config_file(self) -> Path:
        """``config.yaml``: the run's resolved config."""
        return self.path / CONFIG

    def has_checkpoint(self) -> bool:
        """Whether a round completed (``checkpoint.safetensors`` exists)."""
        return (self.path / CHECKPOINT).is_file()

    def completed_rounds(self) -> int:
        """The rounds the run completed (rows of ``metrics.jsonl``)."""
        return completed_rounds(self.path)

    def write_config(self, cfg: Any) -> None:
        """Rewrite ``config.yaml`` atomically with ``cfg.resolved()`` (a resumed run's new
        ``engine.rounds``; the old file stays until the new one is complete)."""
        atomic_write_yaml(self.config_file, cfg.resolved())

    def how_to_resume(self, command: str = "rafl federate --resume") -> str | None:
        """After Ctrl-C / SIGTERM: the line naming the rounds the checkpoint holds and the command
        that continues the run; None when no round completed."""
        if not self.has_checkpoint():
            return None
        return (f"interrupted: {self.completed_rounds()} complete round(s) checkpointed in {self.path}; continue "
                f"with: {command} {shlex.quote(str(self.path))}")


__all__ = ["CONFIG", "RunDir", "default_name", "is_compare_folder", "resumed_config"]
