"""Client state on disk: only the sampled clients are materialized in memory.

Each client's state (a weights-only container, see :mod:`rafl.federation.algorithms.base`) is
one file ``clients/<id>.r<round>.pt`` written atomically with ``torch.save`` and read with
``torch.load(..., weights_only=True)``. Files are *versioned by round*: the engine's checkpoint
records which version of every client is committed, so a crash in the middle of a round leaves
the committed versions untouched and ``--resume`` repeats that round from exactly the same
states. Superseded versions are deleted after the checkpoint that supersedes them is written.
"""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import torch

from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes

_NAME = re.compile(r"^(\d+)\.r(\d+)\.pt$")


def save_state(path: Path, state: Any) -> None:
    """``torch.save(state)`` to ``path`` atomically."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def load_state(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``; UserInputError if missing or corrupt."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserInputError("missing state file (run dir incomplete?)", source=path) from None
    except Exception as err:  # truncated/corrupt pickle, non-weights-only content
        raise UserInputError(f"cannot load state ({err.__class__.__name__}: {err})".splitlines()[0],
                             source=path) from None


class ClientStore:
    """Versioned per-client state files under ``directory``.

    Attributes:
        committed: ``client_id -> round`` of the committed state version (the checkpoint's view).
        pending: ``client_id -> round`` written this round, not yet committed.
    """

    def __init__(self, directory: str | Path, committed: dict[int, int] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.committed: dict[int, int] = dict(committed or {})
        self.pending: dict[int, int] = {}

    def _path(self, client_id: int, rnd: int) -> Path:
        return self.directory / f"{client_id:07d}.r{rnd:05d}.pt"

    def has(self, client_id: int) -> bool:
        """True when the client has a committed state (it was materialized before)."""
        return client_id in self.committed

    def load(self, client_id: int) -> Any:
        """The committed state of ``client_id`` (KeyError if it has none)."""
        return load_state(self._path(client_id, self.committed[client_id]))

    def save(self, client_id: int, rnd: int, state: Any) -> None:
        """Write the state of ``client_id`` after round ``rnd`` (pending until :meth:`commit`)."""
        save_state(self._path(client_id, rnd), state)
        self.pending[client_id] = rnd

    def commit(self) -> dict[int, int]:
        """Make pending versions the committed ones; return the new ``committed`` map. Call
        :meth:`cleanup` after the checkpoint holding this map is on disk."""
        self.committed.update(self.pending)
        self.pending = {}
        return dict(self.committed)

    def cleanup(self) -> None:
        """Delete every file that is not a committed version (older rounds, aborted rounds)."""
        for f in self.directory.iterdir():
            m = _NAME.match(f.name)
            if m is None:
                continue
            cid, rnd = int(m.group(1)), int(m.group(2))
            if self.committed.get(cid) != rnd:
                f.unlink(missing_ok=True)


__all__ = ["ClientStore", "save_state", "load_state"]
