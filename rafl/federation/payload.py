"""What crosses the network: :class:`Payload`, a flat mapping of named tensors plus scalar metadata.

A payload is everything one client uploads in one round, or everything the server broadcasts to
one client. Its serialized size (:meth:`Payload.nbytes`) *is* the communication cost: the engine
counts every upload and every broadcast through it, and nothing else estimates bytes.

Counting (:meth:`Payload.count`) returns a :class:`CountedPayload`: the same tensors and metadata,
frozen (no attribute, tensor name or metadata entry can be set, added or removed), with its byte
count fixed. What the engine sends and what it counted are one object: a client step reads the
counted download (and cannot change what its neighbours, sharing one broadcast, receive), and the
server's own fields of an accepted upload (``client_id``, the registered ``n_samples``) go on a new
payload (:meth:`Payload.with_meta`), never on the counted one.

Wire format: one safetensors blob (`safetensors <https://github.com/huggingface/safetensors>`_):
an 8-byte header length, a JSON header (tensor names, dtypes, shapes, offsets, and a
``__metadata__`` entry holding this payload's metadata as one JSON string) and the raw tensor
bytes. A payload with no tensors and no metadata is "nothing sent" and has ``nbytes() == 0``.

Mapping onto Flower (``flwr.app``, :mod:`rafl.federation.flower_wire`): the blob itself, as one
``uint8`` ``Array`` of an ``ArrayRecord`` per payload (one Flower object per payload instead of
one per tensor; the bytes Flower carries are the bytes counted here).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import FrozenInstanceError, dataclass, field
from types import MappingProxyType
from typing import Any, Union

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from rafl.errors import UserInputError

#: Allowed metadata values: numbers, strings, booleans and flat lists of numbers (e.g. class ids).
MetaValue = Union[int, float, str, bool, list[int], list[float]]

_META_KEY = "rafl"


def check_meta_value(key: str, value: object) -> None:
    """Refuse a metadata value the wire format does not carry (:data:`MetaValue`).

    Raises:
        UserInputError: naming ``payload.meta.<key>`` and the allowed types."""
    if isinstance(value, (bool, int, float, str)):
        return
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value):
        return
    raise UserInputError(f"metadata value of type {type(value).__name__} is not allowed; allowed: "
                         "int, float, str, bool, list of int/float", field=f"payload.meta.{key}")


@dataclass
class Payload:
    """Named tensors + scalar metadata sent in one direction for one client and one round.

    Attributes:
        tensors: flat ``name -> Tensor`` (any shape, any dtype safetensors supports). Tensors are
            detached and moved to CPU on construction. Names are free-form, e.g. ``"knowledge.
            blocks.0.conv.weight"``, ``"proto.3"``.
        meta: flat ``name -> int | float | str | bool | list[int|float]``, e.g. ``{"n_samples":
            123, "class_ids": [0, 3, 7]}``. The server's view of an accepted upload (what
            ``server_aggregate`` receives, :func:`rafl.federation.screening.screen_uploads`) adds
            ``"client_id"`` and sets ``"n_samples"`` to the registered count.

    Raises:
        UserInputError: a metadata value of a type not listed above.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = {str(k): v.detach().to("cpu") for k, v in self.tensors.items()}
        for k, v in self.meta.items():
            check_meta_value(k, v)
        self.meta = {str(k): (list(v) if isinstance(v, tuple) else v) for k, v in self.meta.items()}

    # ------------------------------------------------------------------ helpers
    @classmethod
    def from_state_dict(cls, state: Mapping[str, torch.Tensor], prefix: str = "",
                        meta: dict[str, MetaValue] | None = None) -> Payload:
        """Payload holding ``state`` (e.g. ``model.state_dict()``) with names prefixed by ``prefix``."""
        return cls({prefix + k: v for k, v in state.items()}, dict(meta or {}))

    def state_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The tensors whose names start with ``prefix``, with the prefix stripped."""
        return {k[len(prefix):]: v for k, v in self.tensors.items() if k.startswith(prefix)}

    def is_empty(self) -> bool:
        """True when nothing would be sent (no tensors, no metadata)."""
        return not self.tensors and not self.meta

    def with_meta(self, **meta: MetaValue) -> Payload:
        """A new (uncounted) payload: the same tensors (shared, not copied) and this metadata
        updated by ``meta``.

        Raises:
            UserInputError: a metadata value of a type :class:`Payload` does not allow.
        """
        return Payload(dict(self.tensors), {**self.meta, **meta})

    def count(self) -> CountedPayload:
        """Count the bytes (:meth:`nbytes`, one serialization) and freeze: the counted payload."""
        return CountedPayload(self, self.nbytes())

    # ------------------------------------------------------------------ wire format
    def to_bytes(self) -> bytes:
        """Serialize to one safetensors blob (metadata as JSON in the header); b"" when empty."""
        if self.is_empty():
            return b""
        tensors = {k: v.contiguous() for k, v in self.tensors.items()}
        return _st_save(tensors, metadata={_META_KEY: json.dumps(dict(self.meta), sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes, source: str | None = None, max_bytes: int | None = None) -> Payload:
        """Inverse of :meth:`to_bytes`, checking the blob before any tensor is allocated.

        In order: the blob's length (at most ``max_bytes``), the 8-byte header length (at most
        :data:`MAX_HEADER_BYTES` and within the blob), the JSON header (an object; every tensor's
        dtype one safetensors writes, its shape whole numbers >= 0, its ``data_offsets`` within
        the blob and of exactly ``prod(shape) * itemsize`` bytes), the metadata (a JSON object of
        :data:`MetaValue` s); only then are the tensors read.

        Args:
            data: the wire blob (b"" is the empty payload).
            source: who sent it, for the error (e.g. ``"client 3"``).
            max_bytes: the largest blob accepted, or None.

        Raises:
            UserInputError: a blob over ``max_bytes`` or :data:`MAX_HEADER_BYTES` of header, a
                truncated or corrupt blob, or metadata of a type not allowed, naming ``source``.
        """
        if not data:
            return cls()
        size = len(data)
        if max_bytes is not None and size > max_bytes:
            raise UserInputError(f"holds {size} bytes; allowed: at most {max_bytes} (engine.max_upload_mb)",
                                 source=source)
        header = _checked_header(data, source)
        try:
            meta = json.loads(header.get("__metadata__", {}).get(_META_KEY, "{}"))
        except ValueError:
            raise UserInputError("corrupt payload (its metadata is not JSON)", source=source) from None
        if not isinstance(meta, dict):
            raise UserInputError(f"corrupt payload (its metadata is a {type(meta).__name__}; allowed: a JSON "
                                 "object)", source=source)
        for k, v in meta.items():
            try:
                check_meta_value(k, v)
            except UserInputError as err:
                raise UserInputError(err.message, source=source, field=err.field) from None
        try:
            tensors = _st_load(bytes(data))
        except Exception as err:  # safetensors raises its own error types
            raise UserInputError(f"corrupt or truncated payload ({err.__class__.__name__})",
                                 source=source) from None
        return cls(tensors, meta)

    def nbytes(self) -> int:
        """Serialized size in bytes: safetensors header (names, shapes, dtypes, metadata JSON) +
        raw tensor bytes. 0 for an empty payload. This is *the* communication count."""
        return len(self.to_bytes())

    def num_parameters(self) -> int:
        """Total number of tensor elements."""
        return sum(v.numel() for v in self.tensors.values())

    # ------------------------------------------------------------------ validation
    def validate(self, expected: Mapping[str, tuple[int, ...]] | None = None, *,
                 sender: str = "client", required_meta: tuple[str, ...] = (), nonfinite_hint: str = "") -> Payload:
        """Check a received payload; return self.

        Args:
            expected: ``name -> shape`` the receiver expects (exactly these keys), or None to
                check only finiteness.
            sender: who sent it, used in error messages (e.g. ``"client 7"``).
            required_meta: metadata keys that must be present.
            nonfinite_hint: appended to the NaN/Inf error (the receiver's likely cause and fix).

        Raises:
            UserInputError: a missing/unexpected tensor, a wrong shape, a NaN/Inf value or a
                missing metadata key, naming the sender and the tensor.
        """
        if expected is not None:
            missing = sorted(set(expected) - set(self.tensors))
            extra = sorted(set(self.tensors) - set(expected))
            if missing:
                raise UserInputError(f"missing tensor(s) {missing[:5]}{'...' if len(missing) > 5 else ''}",
                                     source=f"payload from {sender}")
            if extra:
                raise UserInputError(f"unexpected tensor(s) {extra[:5]}{'...' if len(extra) > 5 else ''}; "
                                     f"expected {len(expected)} named tensors", source=f"payload from {sender}")
            for name, shape in expected.items():
                got = tuple(self.tensors[name].shape)
                if got != tuple(shape):
                    raise UserInputError(f"has shape {list(got)}, expected {list(shape)}",
                                         source=f"payload from {sender}", field=name)
        for name, t in self.tensors.items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                raise UserInputError(f"contains NaN or Inf values{nonfinite_hint}", source=f"payload from {sender}",
                                     field=name)
        for key in required_meta:
            if key not in self.meta:
                raise UserInputError(f"missing metadata key {key!r}", source=f"payload from {sender}")
        for key, v in self.meta.items():
            if isinstance(v, float) and not math.isfinite(v):
                raise UserInputError("is NaN or Inf", source=f"payload from {sender}", field=f"meta.{key}")
        return self

    def spec(self) -> dict[str, tuple[int, ...]]:
        """``name -> shape`` of the tensors (what :meth:`validate` takes as ``expected``)."""
        return {k: tuple(v.shape) for k, v in self.tensors.items()}


class CountedPayload(Payload):
    """A :class:`Payload` whose bytes were counted (:meth:`Payload.count`): immutable.

    ``tensors`` and ``meta`` are read-only mappings (list metadata values become tuples; the wire
    format writes them as the same JSON lists), attributes cannot be set, and :meth:`nbytes`
    returns the count made when it was counted. The tensors themselves are the original ones (no
    copy); a reader must not change them in place (``load_state_dict`` copies, as every method does).

    Raises:
        dataclasses.FrozenInstanceError: on setting or deleting an attribute.
        TypeError: on setting or deleting a tensor or metadata entry.
    """

    def __init__(self, payload: Payload, nbytes: int):
        object.__setattr__(self, "tensors", MappingProxyType(dict(payload.tensors)))
        object.__setattr__(self, "meta", MappingProxyType(
            {k: (tuple(v) if isinstance(v, list) else v) for k, v in payload.meta.items()}))
        object.__setattr__(self, "_nbytes", int(nbytes))

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"a counted payload is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"a counted payload is immutable (cannot delete {name!r})")

    def __reduce__(self):
        return (_counted, (dict(self.tensors), {k: (list(v) if isinstance(v, tuple) else v)
                                                for k, v in self.meta.items()}, self._nbytes))

    def nbytes(self) -> int:
        """The serialized size counted when this payload was counted (no serialization)."""
        return self._nbytes

    def count(self) -> CountedPayload:
        """This payload (already counted)."""
        return self


#: the largest safetensors header (tensor names, dtypes, shapes, offsets, metadata) a payload may have
MAX_HEADER_BYTES = 16 << 20
#: bytes per element of the dtypes safetensors writes
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
             "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


def _checked_header(data: bytes, source: str | None) -> dict:
    """The JSON header of the safetensors blob ``data``, checked against the blob's length before
    anything else is read (``Payload.from_bytes``'s checks)."""
    def corrupt(why: str) -> UserInputError:
        return UserInputError(f"corrupt or truncated payload ({why})", source=source)

    size = len(data)
    if size < 8:
        raise corrupt(f"{size} bytes, not even the 8-byte header length")
    n = int.from_bytes(bytes(data[:8]), "little")
    if n > MAX_HEADER_BYTES:
        raise UserInputError(f"has a header of {n} bytes; allowed: at most {MAX_HEADER_BYTES} (names, shapes and "
                             "metadata)", source=source)
    if 8 + n > size:
        raise corrupt(f"a header of {n} bytes in a blob of {size}")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError:
        raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    body = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise corrupt("its __metadata__ is not a mapping of strings")
            continue
        ok = isinstance(entry, dict) and entry.get("dtype") in _ITEMSIZE
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and len(shape) <= 64 and all(
            type(d) is int and 0 <= d < 2**62 for d in shape)
        ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
        if not ok or not 0 <= offsets[0] <= offsets[1] <= body \
                or offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[entry["dtype"]]:
            raise corrupt(f"tensor {str(name)[:60]!r} does not fit its blob")
    return header


def _counted(tensors: dict, meta: dict, nbytes: int) -> CountedPayload:
    """Unpickle a :class:`CountedPayload`."""
    return CountedPayload(Payload(tensors, meta), nbytes)


__all__ = ["Payload", "CountedPayload", "MetaValue", "MAX_HEADER_BYTES", "check_meta_value"]
