"""Client state on disk: only the sampled clients are materialized in memory.

Each client's state (a weights-only container, see :mod:`rafl.federation.algorithms.base`) is
one safetensors file ``clients/<id>.r<round>.st`` written atomically: the tensors flat, the
nesting (dicts, lists, numbers, strings) as JSON in the header -- nothing is ever unpickled, and
loading is a memory copy (faster than ``torch.load(..., weights_only=True)`` on state dicts of
hundreds of small tensors). Files are *versioned by round*: the engine's checkpoint
records which version of every client is committed, so a crash in the middle of a round leaves
the committed versions untouched and ``--resume`` repeats that round from exactly the same
states. Superseded versions are deleted after the checkpoint that supersedes them is written.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from rafl.errors import UserInputError
from rafl.io import atomic_write_bytes, safetensors_damage

_NAME = re.compile(r"^(\d+)\.r(\d+)\.st$")
#: The temporary file of a state write (:func:`rafl.io.atomic_write_bytes`) that a killed process left.
_TEMP = re.compile(r"^\.(\d+)\.r(\d+)\.st\..*\.tmp$")


_TENSOR = "__tensor__"


def _flatten(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Structure of ``obj`` as JSON with every tensor replaced by ``{"__tensor__": key}``."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous()
        return {_TENSOR: key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{path}: state dict keys must be str or int")
        return {"__dict__": [[k, _flatten(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__":
                [_flatten(v, f"{path}[{i}]", tensors) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path}: a state may hold tensors, dicts, lists, tuples, numbers, strings and "
                    f"None, not {type(obj).__name__}")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [_unflatten(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
    return obj


def state_to_bytes(state: Any) -> bytes:
    """Serialize a weights-only state (nested dict/list/tuple of tensors, numbers, strings, None)
    as one safetensors blob: the tensors packed into one flat buffer per dtype (few large tensors
    serialize much faster than hundreds of small ones), the structure and every tensor's
    ``(dtype, offset, shape)`` as JSON in the header metadata.

    Raises:
        TypeError: an object of another type in the state.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(state, "state", tensors)
    groups: dict[str, list[torch.Tensor]] = {}
    layout: dict[str, list] = {}
    sizes: dict[str, int] = {}
    for key, t in tensors.items():
        dt = str(t.dtype).replace("torch.", "")
        groups.setdefault(dt, []).append(t.reshape(-1))
        layout[key] = [dt, sizes.get(dt, 0), list(t.shape)]
        sizes[dt] = sizes.get(dt, 0) + t.numel()
    packed = {dt: torch.cat(parts) if parts else torch.zeros(0) for dt, parts in groups.items()}
    meta = {"rafl.state": json.dumps(structure), "rafl.layout": json.dumps(layout)}
    return _st_save(packed, metadata=meta)


def state_from_bytes(data: bytes) -> Any:
    """Inverse of :func:`state_to_bytes` (no code is unpickled). The returned tensors are
    independent copies."""
    packed = _st_load(data)
    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + header_len])["__metadata__"]
    layout = json.loads(meta["rafl.layout"])
    tensors = {}
    for key, (dt, offset, shape) in layout.items():
        n = 1
        for d in shape:
            n *= int(d)
        tensors[key] = packed[dt][offset:offset + n].reshape(shape).clone()
    return _unflatten(json.loads(meta["rafl.state"]), tensors)


def save_state(path: Path, state: Any) -> None:
    """Write ``state`` to ``path`` atomically as safetensors (:func:`state_to_bytes`)."""
    atomic_write_bytes(path, state_to_bytes(state))


def load_state(path: Path) -> Any:
    """Read a state written by :func:`save_state`; UserInputError if missing or corrupt."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise UserInputError("missing state file (is the run dir's clients/ or, on Flower, the node's state-dir "
                             "incomplete?)", source=path) from None
    try:
        return state_from_bytes(data)
    except Exception as err:  # truncated/corrupt file
        what = safetensors_damage(data) or f"not a rafl state file ({err.__class__.__name__})"
        raise UserInputError(f"cannot load state: {what}", source=path) from None


class ClientStore:
    """Versioned per-client state files under ``directory``.

    Attributes:
        committed: ``client_id -> round`` of the committed state version (the checkpoint's view).
        pending: ``client_id -> round`` written this round, not yet committed.
        background: write (and fsync) the files in a background thread, so the next client
            computes meanwhile; :meth:`flush` (called by :meth:`commit`) waits for them and raises
            the first write error. Off by default: the in-process runner turns it on.
    """

    def __init__(self, directory: str | Path, committed: dict[int, int] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.committed: dict[int, int] = dict(committed or {})
        self.pending: dict[int, int] = {}
        self.background = False
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future] = []

    def _path(self, client_id: int, rnd: int) -> Path:
        return self.directory / f"{client_id:07d}.r{rnd:05d}.st"

    def has(self, client_id: int) -> bool:
        """True when the client has a committed state (it was materialized before)."""
        return client_id in self.committed

    def load(self, client_id: int) -> Any:
        """The committed state of ``client_id`` (KeyError if it has none)."""
        return load_state(self._path(client_id, self.committed[client_id]))

    def save(self, client_id: int, rnd: int, state: Any) -> None:
        """Write the state of ``client_id`` after round ``rnd`` (pending until :meth:`commit`).
        The state is serialized now; with ``background`` the file is written in the background."""
        if not self.background:
            save_state(self._path(client_id, rnd), state)
        else:
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="rafl-client-store")
            self._writes.append(self._writer.submit(atomic_write_bytes, self._path(client_id, rnd),
                                                    state_to_bytes(state)))
        self.pending[client_id] = rnd

    def flush(self) -> None:
        """Wait until every state written so far is on disk (fsync'ed).

        Raises:
            OSError: a background write failed (e.g. the disk is full)."""
        writes, self._writes = self._writes, []
        for w in writes:
            w.result()

    def commit(self) -> dict[int, int]:
        """Make pending versions the committed ones (after :meth:`flush`); return the new
        ``committed`` map. Call :meth:`cleanup` after the checkpoint holding this map is on disk."""
        self.flush()
        self.committed.update(self.pending)
        self.pending = {}
        return dict(self.committed)

    def cleanup(self, client_id: int | None = None) -> None:
        """Delete every file that is not a committed version (older rounds, aborted rounds, the
        temporary file of a write a killed worker process left); only those of ``client_id`` when
        given (a Flower node sharing the folder with other clients)."""
        for f in self.directory.iterdir():
            m = _NAME.match(f.name) or _TEMP.match(f.name)
            if m is None:
                continue
            cid, rnd, temp = int(m.group(1)), int(m.group(2)), f.name.endswith(".tmp")
            if (client_id is None or cid == client_id) and (temp or self.committed.get(cid) != rnd):
                f.unlink(missing_ok=True)


__all__ = ["ClientStore", "save_state", "load_state", "state_to_bytes", "state_from_bytes"]
