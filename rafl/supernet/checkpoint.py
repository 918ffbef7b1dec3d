"""Saving and loading supernets: safetensors weights + a JSON description, written atomically.

A supernet directory holds:

- ``supernet.safetensors``: every parameter and buffer (no pickles; loads without executing code);
- ``supernet.json``: format version, the :class:`SearchSpace`, the resolved training config, the
  metrics, the feature width ``D`` and the SHA-256 of the weights file (to detect truncation).

Both files are written via a temp name + rename, weights first, so a reader never sees a JSON that
describes weights that are not completely on disk.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from rafl.errors import UserInputError, brief
from rafl.io import atomic_write_bytes, atomic_write_json
from rafl.io import read_json_file as bounded
from rafl.supernet.arch import SearchSpace
from rafl.supernet.model import Supernet, build_supernet
from rafl.supernet.pretrained import is_pretrained_name, pretrained_path

FORMAT = "rafl-supernet/1"
WEIGHTS_NAME = "supernet.safetensors"
META_NAME = "supernet.json"


def _state_dict_bytes(supernet: Supernet) -> bytes:
    state = {k: v.detach().cpu().contiguous() for k, v in supernet.state_dict().items()}
    return st_save(state, metadata={"format": FORMAT})


def save_supernet(directory: str | Path, supernet: Supernet, config: dict[str, Any] | None = None,
                  metrics: dict[str, Any] | None = None) -> Path:
    """Write ``supernet`` to ``directory`` (created if needed) as safetensors + JSON, atomically.

    Args:
        directory: output directory; existing supernet files in it are replaced.
        supernet: the model.
        config: resolved training config (JSON-serialisable), stored verbatim.
        metrics: metrics (JSON-serialisable), stored verbatim.

    Returns:
        The path of the JSON file.
    """
    directory = Path(directory)
    data = _state_dict_bytes(supernet)
    atomic_write_bytes(directory / WEIGHTS_NAME, data)
    meta = {
        "format": FORMAT,
        "search_space": supernet.space.to_dict(),
        "feature_dim": supernet.feature_dim,
        "weights": WEIGHTS_NAME,
        "weights_sha256": hashlib.sha256(data).hexdigest(),
        "weights_bytes": len(data),
        "config": config or {},
        "metrics": metrics or {},
    }
    atomic_write_json(directory / META_NAME, meta)
    return directory / META_NAME


def check_meta(meta: Any, path: str | Path) -> dict[str, Any]:
    """Check the fields of a parsed ``supernet.json`` (types and ranges, before any is used); return it.

    ``search_space`` a mapping, ``weights`` a bare file name beside it (never a path elsewhere),
    ``weights_bytes`` an integer >= 0, ``weights_sha256`` 64 hex digits, ``feature_dim`` an
    integer >= 1, ``config`` and ``metrics`` mappings whose numbers are finite.

    Raises:
        UserInputError: naming the file and the field."""
    if not isinstance(meta, dict):
        raise UserInputError("expected a JSON object at the top level", source=path)
    if not isinstance(meta.get("search_space"), dict):
        raise UserInputError(f"is {brief(meta.get('search_space'))}; allowed: a mapping of the search space "
                             "(written by rafl supernet train)", source=path, field="search_space")
    weights = meta.get("weights", WEIGHTS_NAME)
    if not isinstance(weights, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", weights) or weights in (".", ".."):
        raise UserInputError(f"is {brief(weights)}; allowed: a file name beside {META_NAME}", source=path,
                             field="weights")
    for key, ok, what in (
            ("weights_bytes", lambda v: type(v) is int and v >= 0, "an integer >= 0"),
            ("weights_sha256", lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v), "64 hex digits"),
            ("feature_dim", lambda v: type(v) is int and 1 <= v <= 1 << 20, "an integer in 1..2**20"),
            ("config", lambda v: isinstance(v, dict), "a mapping"),
            ("metrics", lambda v: isinstance(v, dict), "a mapping")):
        if key in meta and not ok(meta[key]):
            raise UserInputError(f"is {brief(meta[key])}; allowed: {what}", source=path, field=key)
    conf = meta.get("config") or {}
    for where in (conf, conf.get("data") if isinstance(conf.get("data"), dict) else {}):
        frac, seed = where.get("public_fraction"), where.get("public_seed")
        if frac is not None and not (type(frac) in (int, float) and 0 <= frac < 1):
            raise UserInputError(f"is {brief(frac)}; allowed: a fraction in [0, 1)", source=path,
                                 field="config.public_fraction")
        if seed is not None and not (type(seed) is int and 0 <= seed < 2**32):
            raise UserInputError(f"is {brief(seed)}; allowed: an integer in 0..2**32-1", source=path,
                                 field="config.public_seed")
    stack = [(f"{k}", v) for k in ("config", "metrics") for v in [meta.get(k)] if v is not None]
    while stack:
        name, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise UserInputError("is NaN or Inf; allowed: a finite number", source=path, field=name)
        if isinstance(value, dict):
            stack.extend((f"{name}.{brief(k, 40)}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{name}[{i}]", v) for i, v in enumerate(value))
    return meta


def _space_mismatch(found: SearchSpace, expected: SearchSpace) -> str | None:
    a, b = found.to_dict(), expected.to_dict()
    diffs = [f"{k}={a[k]}" + f", expected {b[k]}" for k in b if a.get(k) != b[k]]
    return "; ".join(f"checkpoint has {d}" for d in diffs) or None


def _describe_shape_mismatch(key: str, found: tuple[int, ...], want: tuple[int, ...]) -> str:
    if key.startswith("classifier.linear.weight"):
        return (f"checkpoint has n_classes={found[0]}, expected {want[0]} "
                f"(classifier feature width {found[1]} vs {want[1]})")
    if key.startswith("classifier.linear.bias"):
        return f"checkpoint has n_classes={found[0]}, expected {want[0]}"
    return (f"tensor {key!r} has shape {list(found)}, expected {list(want)} "
            "(another width multiplier or search space)")


def load_state_into(supernet: Supernet, state: dict[str, torch.Tensor], source: str | Path) -> Supernet:
    """Copy ``state`` into ``supernet`` after checking every key and shape.

    ofa's original checkpoints (``.mobile_inverted_conv.`` naming) are mapped to the current names.

    Raises:
        UserInputError: missing/unexpected tensors or a shape mismatch, named (n_classes, width...).
    """
    state = {k.replace(".mobile_inverted_conv.", ".conv."): v for k, v in state.items()}
    own = supernet.state_dict()
    for key, want in own.items():
        if key not in state:
            raise UserInputError(f"tensor {key!r} is missing (not a checkpoint of this supernet)",
                                 source=source)
        if tuple(state[key].shape) != tuple(want.shape):
            raise UserInputError(_describe_shape_mismatch(key, tuple(state[key].shape), tuple(want.shape)),
                                 source=source)
    extra = sorted(set(state) - set(own))
    if extra:
        raise UserInputError(f"unexpected tensor(s) {extra[:3]} (not a checkpoint of this supernet)",
                             source=source)
    bad = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise UserInputError(f"tensor {bad[0]!r} contains NaN or Inf values ({len(bad)} tensor(s) in all); "
                             "the checkpoint is corrupted or its training diverged", source=source)
    supernet.load_state_dict({k: state[k] for k in own})
    return supernet


def load_supernet(path: str | Path, space: SearchSpace | None = None) -> Supernet:
    """Load a supernet saved by :func:`save_supernet`.

    Args:
        path: the supernet directory, its ``supernet.json``, a bare weights file
            (``.safetensors``, or a ``.pt``/``.pth`` state dict read with ``weights_only=True``,
            e.g. an ofa checkpoint; then ``space`` is required), or the name of a supernet shipped
            with rafl (``"cifar10"``: :mod:`rafl.supernet.pretrained`, checksum-checked).
        space: the expected search space; ``None`` accepts the saved one.

    Returns:
        The supernet in eval mode, on CPU.

    Raises:
        UserInputError: missing, truncated or corrupted files; a checkpoint of another search
            space / width multiplier / number of classes (e.g. "checkpoint has n_classes=1000,
            expected 10").
    """
    path = pretrained_path(str(path)) if is_pretrained_name(str(path)) else Path(path)
    if path.is_dir():
        path = path / META_NAME
    if not path.is_file():
        raise UserInputError(f"no such file (expected a supernet directory with {META_NAME} and "
                             f"{WEIGHTS_NAME})", source=path)
    if path.suffix in (".safetensors", ".pt", ".pth"):
        if space is None:
            raise UserInputError("a bare weights file needs the search space to build the supernet",
                                 source=path, field="space")
        return load_state_into(build_supernet(space), _read_weights(path), path).eval()

    meta = read_json_file(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserInputError(f"format is {brief(meta.get('format') if isinstance(meta, dict) else None)}, "
                             f"expected {FORMAT!r}", source=path, field="format")
    check_meta(meta, path)
    saved_space = SearchSpace.from_dict(meta["search_space"], source=path)
    if space is not None:
        mismatch = _space_mismatch(saved_space, space)
        if mismatch:
            raise UserInputError(mismatch, source=path, field="search_space")
    weights = path.parent / meta.get("weights", WEIGHTS_NAME)
    if not weights.is_file():
        raise UserInputError("weights file is missing", source=weights)
    data = weights.read_bytes()
    if len(data) != meta.get("weights_bytes", len(data)) or \
            hashlib.sha256(data).hexdigest() != meta.get("weights_sha256", hashlib.sha256(data).hexdigest()):
        raise UserInputError(f"has {len(data)} bytes and a checksum that does not match "
                             f"{META_NAME} ({meta.get('weights_bytes')} bytes): truncated or corrupted",
                             source=weights)
    state = _parse_safetensors(data, weights)
    return load_state_into(build_supernet(saved_space), state, weights).eval()


def load_meta(path: str | Path) -> dict[str, Any]:
    """The ``supernet.json`` content of a supernet directory or shipped name (config, metrics, search space).

    Raises:
        UserInputError: missing or malformed file.
    """
    path = pretrained_path(str(path)) if is_pretrained_name(str(path)) else Path(path)
    path = path / META_NAME if path.is_dir() else path
    return check_meta(read_json_file(path), path)


def read_json_file(path: Path) -> Any:
    """The parsed JSON of ``path``.

    Raises:
        UserInputError: missing file, or not valid JSON (naming the file).
    """
    return bounded(path)


def _parse_safetensors(data: bytes, source: Path) -> dict[str, torch.Tensor]:
    try:
        return st_load(data)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise UserInputError(f"not a valid safetensors file (truncated?): {err}", source=source) from None


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return _parse_safetensors(path.read_bytes(), path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a bad file
        raise UserInputError(f"cannot read as a weights-only torch checkpoint "
                             f"({err.__class__.__name__}; truncated?)", source=path) from None
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserInputError("expected a state dict (name -> tensor)", source=path)
    return state


__all__ = ["save_supernet", "load_supernet", "load_meta", "check_meta", "load_state_into", "FORMAT", "WEIGHTS_NAME",
           "META_NAME"]
