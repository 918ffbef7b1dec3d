"""Atomic file and directory writes, and safe checkpoint I/O.

Everything rafl writes (configs, checkpoints, run dirs, reports) goes through a temp name in the
same directory followed by ``os.replace``, so an interrupted command never leaves a half-written
file under the final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_output_dir(path: str | Path, field: str = "--out") -> None:
    """Fail early, before any work, if the folder ``path`` cannot be created or written: the
    nearest existing ancestor must be a folder in which a (probe) folder can be made.

    Raises:
        UserInputError: ``path`` or an ancestor is a file, or the ancestor is not writable
            (read-only or virtual file system, permissions), naming ``field``.
    """
    from rafl.errors import UserInputError

    p = Path(path).absolute()
    anc = p
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        what = "is a file" if anc == p else f"cannot be created: {anc} is a file"
        raise UserInputError(f"{what}; allowed: a new or existing folder", source=p, field=field)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".rafl-probe-", dir=anc))
    except OSError as err:
        raise UserInputError(f"cannot be written: {anc} does not accept new folders ({err.strerror})",
                             source=p, field=field) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader (same scalars: quoted numbers stay text, yes/no are booleans, ...) that
    refuses a mapping holding a key twice; PyYAML keeps the last value silently, so a profile with
    ``name: b`` and later ``name: c`` was read as ``c``. Merge keys (``<<: *base``) may still be
    overridden by the mapping's own keys."""

    rafl_source: str | Path | None = None

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: the base constructor reports it
                    continue
                if repeated:
                    from rafl.errors import DuplicateKeyError

                    raise DuplicateKeyError(key, line, seen[key], source=self.rafl_source)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str | Path | None = None) -> Any:
    """Parse YAML (or JSON) ``text`` like ``yaml.safe_load``, refusing duplicate mapping keys.

    Every YAML file rafl reads (device profiles, run configs, supernet train configs, arch files,
    latency LUTs) goes through here.

    Raises:
        DuplicateKeyError: a mapping holds a key twice (a :class:`rafl.errors.UserInputError`
            naming ``source``, the key and both lines).
        yaml.YAMLError: malformed YAML, as ``yaml.safe_load``.
    """
    loader = _UniqueKeyLoader(text)
    loader.rafl_source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; follow the user's umask
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def claim_file(path: str | Path, field: str = "--out") -> None:
    """Create ``path`` empty, atomically and only if it does not exist (``O_EXCL``): a run's claim on
    its folder before it writes there (the file is then replaced with its content by an atomic
    write). Two runs started together into one folder used to both write into it.

    Raises:
        UserInputError: ``path`` exists (another run is writing into that folder), naming ``field``.
    """
    from rafl.errors import UserInputError

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except FileExistsError:
        raise UserInputError(f"another run is writing into this folder ({path.name} appeared a moment ago); "
                             "allowed: a new or empty folder", source=path.parent, field=field) from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Text (UTF-8) version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_yaml(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as YAML (safe dumper), atomically."""
    atomic_write_text(path, yaml.safe_dump(obj, sort_keys=False))


@contextlib.contextmanager
def atomic_dir(path: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temp name; rename it to ``path`` only if the block succeeds.

    Yields the temp directory to write into. On any exception the temp directory is removed and
    nothing exists under ``path`` (unless it existed before and ``overwrite`` is False, in which
    case a FileExistsError is raised up front).
    """
    path = Path(path)
    if path.exists() and not overwrite and any(path.iterdir()):
        raise FileExistsError(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; follow the user's umask
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def safetensors_damage(data: bytes) -> str | None:
    """What is wrong with ``data`` as a safetensors file, as a phrase for an error message, or None
    when its framing is intact (an 8-byte little-endian header length, a JSON header, and tensor
    data up to the largest ``data_offsets`` end the header lists; the format of
    https://github.com/huggingface/safetensors). A file cut short (an interrupted copy, a full
    disk) reads ``truncated: 1,000 of 5,000 bytes``, so the message can say so rather than
    "not a rafl file"."""
    size = len(data)
    if size < 8:
        return f"truncated: {size:,} bytes, not even the 8-byte header length of a safetensors file"
    n = int.from_bytes(data[:8], "little")
    if n > 100_000_000:
        return "not a safetensors file (its first 8 bytes are no header length)"
    if size < 8 + n:
        return f"truncated: {size:,} bytes, but its safetensors header alone is {8 + n:,} bytes"
    try:
        header = json.loads(data[8:8 + n])
    except (ValueError, UnicodeDecodeError):
        return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    end = max((int(v["data_offsets"][1]) for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if size < 8 + n + end:
        return f"truncated: {size:,} of {8 + n + end:,} bytes"
    return None
