"""Atomic file and directory writes, and safe checkpoint I/O.

Everything rafl writes (configs, checkpoints, run dirs, reports) goes through a temp name in the
same directory followed by ``os.replace``, so an interrupted command never leaves a half-written
file under the final name.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from rafl.errors import DuplicateKeyError, UserInputError


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
                    raise DuplicateKeyError(key, line, seen[key], source=self.rafl_source)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


#: Limits of every YAML/JSON document rafl reads (:func:`load_yaml`, :func:`load_json`,
#: :func:`read_text_file`): a hostile or corrupted file is one UserInputError, never a hang, a
#: RecursionError or a memory blow-up.
MAX_YAML_BYTES = 8 << 20
#: JSON files hold index lists (partitions of 800k samples are ~6 MB)
MAX_JSON_BYTES = 256 << 20
#: nesting of mappings and sequences
MAX_DEPTH = 64
#: alias references (``*name``) in one YAML document
MAX_ALIASES = 1000
#: nodes of a YAML document with every alias expanded (what a reader of the value walks)
MAX_EXPANDED_NODES = 1_000_000
#: digits of one integer
MAX_INT_DIGITS = 64
#: values (scalars, sequences, mappings) written in one YAML document, before aliases are expanded;
#: counted by libyaml's event parser before the document is composed (rafl's largest YAML files,
#: latency LUTs, hold a few thousand)
MAX_YAML_NODES = 100_000


def _limit_error(message: str, source: str | Path | None, field: str | None = None):
    return UserInputError(message, source=source, field=field)


class _BoundedLoader(_UniqueKeyLoader):
    """:class:`_UniqueKeyLoader` with the limits above, checked while composing (before any value
    is built): depth, alias count, the alias-expanded node count (a "billion laughs" document
    of 2 KB expands to 10**9 nodes) and integer length."""

    def __init__(self, stream):
        super().__init__(stream)
        self.rafl_depth = 0
        self.rafl_aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.rafl_aliases += 1
            if self.rafl_aliases > MAX_ALIASES:
                raise _limit_error(f"uses more than {MAX_ALIASES} aliases (*name); allowed: at most {MAX_ALIASES}",
                                   self.rafl_source)
            return super().compose_node(parent, index)
        self.rafl_depth += 1
        if self.rafl_depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _limit_error(f"is nested deeper than {MAX_DEPTH} levels (line {mark.line + 1}); allowed: at most "
                               f"{MAX_DEPTH}", self.rafl_source)
        try:
            return super().compose_node(parent, index)
        finally:
            self.rafl_depth -= 1

    def construct_yaml_int(self, node):
        digits = sum(ch.isalnum() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise _limit_error(f"has an integer of {digits} digits at line {node.start_mark.line + 1}; allowed: "
                               f"at most {MAX_INT_DIGITS}", self.rafl_source)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _expanded_nodes(root, source: str | Path | None) -> int:
    """Nodes of the composed YAML graph ``root`` with aliases expanded; raises at a recursive alias
    or past :data:`MAX_EXPANDED_NODES` (a shared node counts once per reference)."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise _limit_error("holds a recursive alias (a value that contains itself)", source)
        visiting.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        visiting.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise _limit_error(f"expands to more than {MAX_EXPANDED_NODES} values through its aliases (*name); "
                               f"allowed: at most {MAX_EXPANDED_NODES}", source)
        sizes[key] = total
        return total

    return size(root) if root is not None else 0


def _prescan_yaml(text: str, source: str | Path | None) -> None:
    """Count the values, aliases and nesting of ``text`` with libyaml's event parser (C; PyYAML's
    pure-Python one where libyaml is missing) before any node is built, and refuse a document over
    :data:`MAX_YAML_NODES`, :data:`MAX_ALIASES` or :data:`MAX_DEPTH`. Malformed YAML is left to the
    composing loader, whose message names the line and column."""
    parser = yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader
    nodes = aliases = depth = 0
    try:
        for event in yaml.parse(text, Loader=parser):
            if isinstance(event, yaml.AliasEvent):
                aliases += 1
                if aliases > MAX_ALIASES:
                    raise _limit_error(f"uses more than {MAX_ALIASES} aliases (*name); allowed: at most {MAX_ALIASES}",
                                       source)
            elif isinstance(event, yaml.NodeEvent):
                nodes += 1
                if nodes > MAX_YAML_NODES:
                    raise _limit_error(f"has more than {MAX_YAML_NODES} values (line {event.start_mark.line + 1}); "
                                       f"allowed: at most {MAX_YAML_NODES} values in a YAML file", source)
                if isinstance(event, yaml.CollectionStartEvent):
                    depth += 1
                    if depth > MAX_DEPTH:
                        raise _limit_error(f"is nested deeper than {MAX_DEPTH} levels (line {event.start_mark.line + 1});"
                                           f" allowed: at most {MAX_DEPTH}", source)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        return


def load_yaml(text: str, source: str | Path | None = None) -> Any:
    """Parse YAML (or JSON) ``text`` like ``yaml.safe_load``, refusing duplicate mapping keys and
    documents over the limits (:data:`MAX_YAML_BYTES`, :data:`MAX_YAML_NODES`, :data:`MAX_DEPTH`,
    :data:`MAX_ALIASES`, :data:`MAX_EXPANDED_NODES`, :data:`MAX_INT_DIGITS`); the values, aliases
    and nesting are counted by an event parser before any node is composed.

    Every YAML file rafl reads (device profiles, run configs, supernet train configs, arch files,
    latency LUTs) goes through here.

    Raises:
        DuplicateKeyError: a mapping holds a key twice (a :class:`rafl.errors.UserInputError`
            naming ``source``, the key and both lines).
        UserInputError: a document over a limit, naming ``source`` and the limit.
        yaml.YAMLError: malformed YAML, as ``yaml.safe_load``.
    """
    if len(text) > MAX_YAML_BYTES:
        raise _limit_error(f"has {len(text)} characters; allowed: at most {MAX_YAML_BYTES} in a YAML file", source)
    _prescan_yaml(text, source)
    loader = _BoundedLoader(text)
    loader.rafl_source = source
    try:
        node = loader.get_single_node()
        _expanded_nodes(node, source)
        return loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()


def _json_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits; allowed: at most {MAX_INT_DIGITS}")
    return int(text)


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON; allowed: finite numbers")


def _json_depth(obj: Any) -> int:
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def load_json(text: str | bytes, source: str | Path | None = None) -> Any:
    """Parse JSON ``text`` (the standard library's parser) within the limits: at most
    :data:`MAX_JSON_BYTES`, nesting :data:`MAX_DEPTH`, integers of :data:`MAX_INT_DIGITS`
    digits; ``NaN``/``Infinity`` (which Python's json accepts) are refused.

    Raises:
        UserInputError: not valid JSON or over a limit, naming ``source`` (the parser's position,
            never the value).
    """
    if len(text) > MAX_JSON_BYTES:
        raise _limit_error(f"has {len(text)} bytes; allowed: at most {MAX_JSON_BYTES} in a JSON file", source)
    try:
        obj = json.loads(text, parse_int=_json_int, parse_constant=_json_constant)
    except RecursionError:
        raise _limit_error(f"is nested deeper than {MAX_DEPTH} levels; allowed: at most {MAX_DEPTH}", source) from None
    except json.JSONDecodeError as err:
        raise _limit_error(f"not valid JSON (truncated or corrupted?): {err.msg} at line {err.lineno} column "
                           f"{err.colno}", source) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise _limit_error(f"not valid JSON: {str(err)[:200]}", source) from None
    if _json_depth(obj) > MAX_DEPTH:
        raise _limit_error(f"is nested deeper than {MAX_DEPTH} levels; allowed: at most {MAX_DEPTH}", source)
    return obj


def read_text_file(path: str | Path, limit: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of ``path``, at most ``limit`` bytes (checked before reading).

    Raises:
        UserInputError: no such file, not a regular file or larger than ``limit``, naming the file.
        UnicodeDecodeError: not UTF-8 text."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise _limit_error("is not a regular file", path)
        if size > limit:
            raise _limit_error(f"has {size} bytes; allowed: at most {limit}", path)
        with path.open("rb") as fh:
            data = fh.read(size + 1)  # (read(limit) would allocate the whole limit up front)
    except FileNotFoundError:
        raise _limit_error("no such file", path) from None
    except OSError as err:
        raise _limit_error(f"cannot be read ({err.strerror})", path) from None
    if len(data) > limit:
        raise _limit_error(f"has more than {limit} bytes; allowed: at most {limit}", path)
    return data.decode("utf-8")  # UnicodeDecodeError: the caller names the format ("not valid YAML")


def read_yaml_file(path: str | Path) -> Any:
    """:func:`load_yaml` of the file ``path`` (:func:`read_text_file`'s limits).

    Raises:
        UserInputError: as :func:`read_text_file` and :func:`load_yaml`.
        yaml.YAMLError, UnicodeDecodeError: malformed YAML, not UTF-8 text."""
    return load_yaml(read_text_file(path, MAX_YAML_BYTES), path)


def read_json_file(path: str | Path) -> Any:
    """:func:`load_json` of the file ``path`` (at most :data:`MAX_JSON_BYTES`).

    Raises:
        UserInputError: as :func:`read_text_file` and :func:`load_json`, or not UTF-8 text."""
    try:
        text = read_text_file(path, MAX_JSON_BYTES)
    except UnicodeDecodeError as err:
        raise _limit_error(f"not valid JSON (not UTF-8 text at byte {err.start})", path) from None
    return load_json(text, path)


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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except FileExistsError:
        raise UserInputError(f"another run is writing into this folder ({path.name} appeared a moment ago); "
                             "allowed: a new or empty folder", source=path.parent, field=field) from None


def lock_dir(path: str | Path, field: str = "--out") -> int:
    """Hold an exclusive ``flock`` on the folder ``path`` for as long as the returned descriptor is
    open (the kernel releases it when the process ends, also on ``kill -9``): a run's claim on its
    run dir, so a later command can tell a dead run's folder from a live one's.

    Returns:
        the open descriptor (close it, or let the process end, to release the lock).

    Raises:
        UserInputError: another live process holds the lock, naming ``field``."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserInputError("another run is writing into this folder now; allowed: a folder no live run uses",
                             source=path, field=field) from None
    return fd


def remove_orphaned_tmp(folder: str | Path) -> list[str]:
    """Delete the temporary files and folders an interrupted atomic write left in ``folder``
    (names ``.<name>.<random>.tmp`` from :func:`atomic_write_bytes` / :func:`atomic_dir`); only
    call it while no other process writes there (a resumed run holds its :func:`lock_dir`).

    Returns:
        the names removed."""
    removed = []
    for p in Path(folder).glob(".*.tmp"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        removed.append(p.name)
    return sorted(removed)


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
