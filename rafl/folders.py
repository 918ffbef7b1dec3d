"""Output folders: the three kinds a rafl command writes, and each kind's rules in one place.

- **run** (:class:`RunFolder`): written over time and resumable: ``rafl federate``'s and the
  Flower App's run dirs, ``rafl compare``'s per-method runs, ``rafl supernet train``. A new run
  starts in a new or empty folder; one holding a run of its kind that never completed a step
  (round, epoch) is taken over (emptied, with a warning) or refused, as its :class:`RunKind`
  says. Lock: held while the run writes (``--resume`` included). On failure: a new run that
  completed no step leaves nothing.
- **comparison** (:class:`Comparison`): ``rafl compare``'s folder (and each ``--tune`` trial's):
  its record ``config.yaml``, the tables and one run folder per method. A new one starts in a new
  or empty folder, or one holding only its own ``--tune`` trials. Lock: held while it writes, and
  the record claimed first (``O_EXCL``). On failure: the method's run as a run's; when no
  method's run is left in a new comparison, its record (and the folder it created) too.
- **written once** (:class:`OnceKind`): ``rafl data``, ``rafl profile``, ``rafl search``'s
  per-profile folders. It goes into a new or empty folder, or one holding only the command's
  earlier output (replaced) and what an interrupted atomic write left. No lock. On failure:
  nothing half-written (built under a temporary name, renamed when complete).

The lock is :func:`rafl.io.lock_dir` (a ``flock`` the kernel drops when the process ends, also on
``kill -9``), so a live run's folder is refused to a second writer and a dead one's is not; a
folder checked long before it is written is claimed by creating its first file with ``O_EXCL``
(:func:`rafl.io.claim_file`). What tells a command's own files from anything else (a run's
``config.yaml``, a report's file names) is declared next to those files, as a :class:`RunKind` or
:class:`OnceKind`; the rules that use it are here, and every command goes through them. The
commands call the checks before torch loads where they can, and the work modules call them again:
this module imports no torch (``lint-imports``' contract "check modules import no torch").
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rafl.errors import UserInputError, warn
from rafl.io import atomic_dir, check_output_dir, claim_file, lock_dir

#: the error of an output path that is a file
NOT_A_FOLDER = "exists and is not a folder; allowed: a new or empty folder"


def is_temp(entry: Path) -> bool:
    """Whether ``entry`` is what an interrupted atomic write left (``.<name>.<random>.tmp``:
    :func:`rafl.io.atomic_write_bytes`, :func:`rafl.io.atomic_dir`)."""
    return entry.name.startswith(".") and entry.name.endswith(".tmp")


def check_folder(path: str | Path, field: str | None = "--out") -> None:
    """``path`` is a folder or does not exist.

    Raises:
        UserInputError: ``path`` is a file (or anything but a folder), naming ``field``."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserInputError(NOT_A_FOLDER, source=path, field=field)


def check_creatable(path: str | Path, field: str = "--out") -> None:
    """The folder ``path`` can be created or written (:func:`rafl.io.check_output_dir`), checked
    before any work.

    Raises:
        UserInputError: ``path`` or an ancestor is a file, or the nearest existing ancestor does
            not accept new folders, naming ``field``."""
    check_output_dir(path, field)


def _empty(path: Path) -> None:
    for p in list(path.iterdir()):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _remove(path: Path, *, made: bool) -> None:
    """Remove what a new run wrote into ``path``: the folder when ``made`` (the run, or a dead run
    of its kind, created it), else only its contents (the folder was there, empty, before)."""
    if not path.is_dir():
        return
    if made:
        shutil.rmtree(path, ignore_errors=True)
    else:
        _empty(path)


# ---------------------------------------------------------------------------------------- kind 1: run
@dataclass(frozen=True)
class RunKind:
    """How a command tells its own run folder from anything else (the rules: :class:`RunFolder`).

    Attributes:
        started: whether a folder holds (part of) a run of this kind.
        completed: whether that run completed a step that a resume continues (a checkpoint).
        foreign: the error for a non-empty folder that holds no run of this kind.
        taken: the error for a folder whose run completed a step (``{path}``: the folder).
        dead: the error for a folder whose run never completed a step (``{path}``: the folder);
            None: a new run takes such a folder over (emptied, with a warning) unless a live run
            holds its lock.
        step: what a run completes (``round``, ``epoch``), for the warning of a take-over.
    """

    started: Callable[[Path], bool]
    completed: Callable[[Path], bool]
    foreign: str
    taken: str
    dead: str | None = None
    step: str = "round"


class RunFolder:
    """A run folder (kind 1) held by this process: written over time, resumable. It holds the
    folder's lock until :meth:`close`; a ``with`` block closes it and, on an exception, first
    :meth:`discard_if_incomplete`.

    Attributes:
        path: the folder.
        kind: its :class:`RunKind`.
        resumed: it continues an earlier run (:meth:`reopen`).
    """

    def __init__(self, path: str | Path, kind: RunKind, *, resumed: bool, fd: int, made: bool = False,
                 parent_made: Path | None = None):
        self.path, self.kind, self.resumed = Path(path), kind, resumed
        self._fd: int | None = fd
        self._made = made  # the folder is this run's (created by it, or by a dead run it took over)
        self._parent_made = parent_made  # the parent folder this claim created (removed again if left empty)

    # ------------------------------------------------------------------ opening
    @staticmethod
    def check_new(path: str | Path, kind: RunKind, field: str | None = None) -> bool:
        """Whether ``path`` can take a new run of ``kind``: it does not exist, is empty, or (where
        ``kind.dead`` is None) holds a run of its kind that never completed a step, which the new
        run takes over; returns True in that last case.

        Raises:
            UserInputError: (naming ``path`` and ``field``) ``path`` is a file, holds something
                that is not a run of ``kind`` (``kind.foreign``), a run that completed a step
                (``kind.taken``), or one that never did where ``kind`` refuses it (``kind.dead``)."""
        path = Path(path)
        check_folder(path, field)
        if not path.is_dir() or not any(path.iterdir()):
            return False
        if not kind.started(path):
            raise UserInputError(kind.foreign, source=path, field=field)
        if kind.completed(path):
            raise UserInputError(kind.taken.format(path=path), source=path, field=field)
        if kind.dead is not None:
            raise UserInputError(kind.dead.format(path=path), source=path, field=field)
        return True

    @classmethod
    def start(cls, path: str | Path, kind: RunKind, *, field: str | None = None,
              claim: str | None = None) -> RunFolder:
        """Create and hold ``path`` for a new run of ``kind`` (:meth:`check_new`, again once its
        lock is held): the folder and its parents are created, a run of its kind that never
        completed a step is emptied (with a warning). ``claim``: a file created first with
        ``O_EXCL`` (:func:`rafl.io.claim_file`), for a folder checked long before it is written.

        Raises:
            UserInputError: what :meth:`check_new` refuses, a live run holds the folder's lock,
                or (``claim``) the file appeared meanwhile; naming ``field``."""
        path = Path(path)
        cls.check_new(path, kind, field)
        made = not path.exists()
        parent_made = None if path.parent.exists() else path.parent
        path.mkdir(parents=True, exist_ok=True)
        fd = lock_dir(path, field)
        try:
            take_over = cls.check_new(path, kind, field)  # under the lock: what a run wrote in between
            if claim is not None:
                claim_file(path / claim, field)
        except BaseException:
            os.close(fd)
            raise
        if take_over:
            _empty(path)
            warn(f"{path} never completed a {kind.step} (its run was killed before the first checkpoint): "
                 "starting it afresh")
        return cls(path, kind, resumed=False, fd=fd, made=made or take_over, parent_made=parent_made)

    @classmethod
    def start_unique(cls, out: str | Path, stem: str, kind: RunKind, *, field: str | None = None) -> RunFolder:
        """Create and hold a new folder ``out/stem`` for a new run of ``kind``, or ``stem-2``, ``-3``,
        ... when runs started in the same second (a sweep) took it: each is made with an atomic
        ``mkdir``, so parallel runs never share (or clean up) one folder.

        Raises:
            UserInputError: a live run holds the new folder's lock (it cannot: nothing else made it)."""
        out = Path(out)
        parent_made = None if out.exists() else out
        path, i = out / stem, 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                i += 1
                path = out / f"{stem}-{i}"
        return cls(path, kind, resumed=False, fd=lock_dir(path, field), made=True, parent_made=parent_made)

    @classmethod
    def reopen(cls, path: str | Path, kind: RunKind, *, field: str | None = None) -> RunFolder:
        """Hold ``path`` to continue its run (what may be continued is the command's own check).

        Raises:
            UserInputError: a live run holds the folder's lock, naming ``field``."""
        return cls(path, kind, resumed=True, fd=lock_dir(path, field))

    # ------------------------------------------------------------------ ending
    def discard_if_incomplete(self) -> bool:
        """:meth:`discard` a new run that completed no step; a resumed run, or one that completed a
        step, stays. Returns whether it discarded it."""
        if self.resumed or not self.path.exists() or self.kind.completed(self.path):
            return False
        self.discard()
        return True

    def discard(self) -> None:
        """Remove what this new run wrote: its folder (only its contents where the folder was
        there, empty, before the run), then the parent folder its claim created if that is left
        empty. A resumed run is never removed.

        Raises:
            RuntimeError: the run is a resumed one."""
        if self.resumed:
            raise RuntimeError(f"{self.path} continues an earlier run: it is never discarded")
        _remove(self.path, made=self._made)
        parent = self._parent_made
        if parent is not None and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None:
                self.discard_if_incomplete()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, resumed={self.resumed})"


# ---------------------------------------------------------------------------------------- kind 2: comparison
#: a comparison's record, its first file (claimed with ``O_EXCL``): what ``--resume`` opens
COMPARISON_RECORD = "config.yaml"
#: what ``rafl compare --tune`` writes into the folder before the comparison: its trials and their record
TUNE_DIR, TUNE_RECORD = "tune", "tune.json"


class Comparison:
    """A comparison folder (kind 2) held by this process: ``config.yaml`` (the record), the table
    and plots, and one run folder (kind 1) per method (:meth:`method`). It holds the folder's lock
    until :meth:`close` (also as a ``with`` block).

    Attributes:
        path: the folder.
        resumed: it continues an earlier comparison.
    """

    def __init__(self, path: str | Path, *, resumed: bool, fd: int, made: bool = False):
        self.path, self.resumed = Path(path), resumed
        self._fd: int | None = fd
        self._made = made
        self._methods: list[RunFolder] = []

    @staticmethod
    def check_new(out: str | Path, field: str = "--out") -> None:
        """``out`` can take a new comparison: it can be created or written, and is new, empty, or
        holds only this comparison's ``--tune`` trials (:data:`TUNE_DIR`, :data:`TUNE_RECORD`).

        Raises:
            UserInputError: (naming ``field``) what :func:`check_creatable` refuses, or a folder
                holding anything else."""
        out = Path(out)
        check_creatable(out, field)
        if out.is_dir() and any(p.name not in (TUNE_DIR, TUNE_RECORD) for p in out.iterdir()):
            raise UserInputError("already exists and is not empty; choose another --out (or --resume it)",
                                 source=out, field=field)

    @staticmethod
    def check_resume(out: str | Path, field: str = "--resume") -> None:
        """``out`` holds a comparison to continue (its :data:`COMPARISON_RECORD`).

        Raises:
            UserInputError: ``out`` does not exist or holds no record, naming ``field``."""
        out = Path(out)
        if not (out / COMPARISON_RECORD).is_file():
            raise UserInputError("does not exist" if not out.exists() else
                                 f"is not a rafl compare output (no {COMPARISON_RECORD})", source=out, field=field)

    @classmethod
    def open(cls, out: str | Path, *, resume: bool, field: str) -> Comparison:
        """Create (unless ``resume``) and hold ``out``: a new comparison claims its record first
        (:func:`rafl.io.claim_file`, so of two comparisons started together into one folder, one
        stops here); the caller checked ``out`` before (:meth:`check_new`, :meth:`check_resume`).

        Raises:
            UserInputError: a live comparison holds the folder's lock, or (new) another one claimed
                it, naming ``field``."""
        out = Path(out)
        made = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        fd = lock_dir(out, field)
        if not resume:
            try:
                claim_file(out / COMPARISON_RECORD, field)
            except BaseException:
                os.close(fd)
                raise
        return cls(out, resumed=resume, fd=fd, made=made)

    def method(self, name: str, kind: RunKind, *, resume: bool, field: str | None = None) -> RunFolder:
        """Hold the run folder ``<folder>/<name>`` of one method: a new run (:meth:`RunFolder.start`)
        or, with ``resume``, one that continues (:meth:`RunFolder.reopen`).

        Raises:
            UserInputError: what :meth:`RunFolder.start` / :meth:`RunFolder.reopen` refuse."""
        path = self.path / name
        run = RunFolder.reopen(path, kind, field=field) if resume else RunFolder.start(path, kind, field=field)
        self._methods.append(run)
        return run

    def discard_failed(self, run: RunFolder) -> None:
        """After a method's run failed: leave nothing half-made. Its run folder goes unless it
        completed a step (:meth:`RunFolder.discard_if_incomplete`); when this is a new comparison
        and no method's run folder is left, its record (and the folder, if it created it and it is
        left empty) go too, so the same command can simply be run again. Finished methods are never
        touched."""
        run.discard_if_incomplete()
        if self.resumed or any(m.path.exists() for m in self._methods):
            return
        (self.path / COMPARISON_RECORD).unlink(missing_ok=True)
        if self._made and self.path.is_dir() and not any(self.path.iterdir()):
            self.path.rmdir()

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Comparison:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- kind 3: written once
@dataclass(frozen=True)
class OnceKind:
    """A command's output folder written once (kind 3), and how the command tells its own files.

    Attributes:
        command: the command, as its errors name it (```rafl data```).
        owns: whether an entry of the folder is that command's earlier output.
    """

    command: str
    owns: Callable[[Path], bool]

    def check(self, out: str | Path, field: str = "--out") -> None:
        """``out`` can take the output: it does not exist, is empty, or holds only the command's
        earlier output (replaced) and what an interrupted atomic write left (:func:`is_temp`).

        Raises:
            UserInputError: (naming ``out`` and ``field``) a file, or a folder holding anything
                else (its first three such names)."""
        out = Path(out)
        check_folder(out, field)
        if not out.is_dir():
            return
        foreign = sorted(p.name for p in out.iterdir() if not (self.owns(p) or is_temp(p)))
        if foreign:
            raise UserInputError(f"holds files that are not {self.command} output ({', '.join(foreign[:3])}); "
                                 f"allowed: a new or empty folder, or one holding only {self.command} output",
                                 source=out, field=field)

    @contextlib.contextmanager
    def write(self, out: str | Path, *, entry: str | None = None, field: str = "--out") -> Iterator[Path]:
        """Check ``out`` again (:meth:`check`), then build the output in a temporary folder beside
        its target and rename it there when the block succeeds (:func:`rafl.io.atomic_dir`): the
        target is ``out`` (the earlier output replaced), or with ``entry`` only ``out/entry`` (the
        folder's other entries kept: ``rafl search``'s per-profile folders). On any exception the
        temporary folder is removed and the target is as it was.

        Yields:
            the temporary folder to write into.

        Raises:
            UserInputError: what :meth:`check` refuses."""
        out = Path(out)
        self.check(out, field)
        with atomic_dir(out if entry is None else out / entry, overwrite=True) as tmp:
            yield tmp


__all__ = ["COMPARISON_RECORD", "NOT_A_FOLDER", "TUNE_DIR", "TUNE_RECORD", "Comparison", "OnceKind", "RunFolder",
           "RunKind", "check_creatable", "check_folder", "is_temp"]
