"""rafl's payloads in Flower messages: the record names, the message types, and a payload as
one ``uint8`` ``Array`` of an ``ArrayRecord`` holding its wire blob.

What travels (:mod:`rafl.federation.payload`): a payload is its wire blob
(:meth:`Payload.to_bytes`: safetensors, tensors by name, metadata in the header) in one ``uint8``
array of the ``ArrayRecord`` ``"payload.<slot>"``: one Flower object per payload, not per tensor,
and exactly the bytes the engine counts. A broadcast several clients share travels once per
message (slots ``0, 1, ...``), an upload under its client id's slot (``.<client id>``),
evaluation counts as the ``MetricRecord`` ``"metrics.<client id>"``. The control record
``"rafl"`` holds the client ids (in job order), each one's payload slot and the client state
version the server has committed, the round, the run key and the run config (YAML text); a
reply's holds ``client_errors`` (client steps that failed on the node) or the ``user_error``
that stopped it.

Used by both sides: the server's runner (:mod:`rafl.federation.flower_runner`) and the node's
ClientApp (:mod:`rafl.stages.flower.node`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from rafl.errors import UserInputError
from rafl.federation.payload import Payload

#: Record names in a Flower message's ``RecordDict`` (a payload's record is ``PAYLOAD + slot``) and
#: the name of the one array a payload record holds.
PAYLOAD, CONTROL, BLOB = "payload", "rafl", "safetensors"
#: Message types: the ServerApp's node query and the two client steps.
QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"


def _flwr():
    try:
        from flwr import app  # noqa: PLC0415 - flwr is optional (rafl[flower]): without it, this error
    except ImportError:  # pragma: no cover - depends on the environment
        raise UserInputError("the Flower backend needs flwr: pip install 'rafl[flower]'",
                             field="engine.backend") from None
    return app


# ---------------------------------------------------------------------- payload <-> records
def payload_to_records(payload: Payload, slot: str = "") -> dict[str, Any]:
    """``{PAYLOAD + slot: ArrayRecord}`` holding ``payload`` as its wire blob
    (:meth:`Payload.to_bytes`, safetensors, metadata in its header) in one ``uint8`` ``Array``
    named ``"safetensors"``; ``slot`` (e.g. ``".3"``) tells apart the payloads of one message.

    One array, not one per tensor: Flower 1.42 moves every ``Array`` of a message as objects of
    their own (an HTTP request each between SuperNode and SuperLink), so rafl's knowledge network
    (231 tensors) cost 231 requests per client and direction; and the bytes Flower carries are
    exactly the ones the engine counts."""
    return _blob_records(payload.to_bytes(), slot)


def _blob_records(blob: bytes, slot: str) -> dict[str, Any]:
    """:func:`payload_to_records` of an already serialized payload."""
    app = _flwr()
    return {PAYLOAD + slot: app.ArrayRecord({BLOB: app.Array(np.frombuffer(blob, dtype=np.uint8))})}


def records_to_payload(content: Any, sender: str, slot: str = "", max_bytes: int | None = None) -> Payload:
    """Inverse of :func:`payload_to_records`; a blob over ``max_bytes`` is refused unparsed.

    Raises:
        UserInputError: a message without the payload record, a blob over ``max_bytes``, or a
            corrupt blob, naming ``sender``."""
    name = PAYLOAD + slot
    record = content.array_records.get(name)
    if record is None or BLOB not in record:
        raise UserInputError(f"carries no rafl payload {name!r} (records {sorted(content.keys())[:10]})",
                             source=sender)
    array = record[BLOB]
    size = len(array.data) if isinstance(getattr(array, "data", None), bytes) else None  # .npy: blob + its header
    if max_bytes is not None and size is not None and size > max_bytes + 4096:
        raise UserInputError(f"holds about {size} bytes; allowed: at most {max_bytes} (engine.max_upload_mb)",
                             source=sender)
    blob = array.numpy().tobytes()
    if max_bytes is not None and len(blob) > max_bytes:
        raise UserInputError(f"holds {len(blob)} bytes; allowed: at most {max_bytes} (engine.max_upload_mb)",
                             source=sender)
    return Payload.from_bytes(blob, source=sender)


def _blob_size(content: Any, slot: str) -> int:
    """Bytes of the payload blob in ``content`` (0 when it has none), without copying it."""
    record = content.array_records.get(PAYLOAD + slot)
    data = getattr(record[BLOB], "data", b"") if record is not None and BLOB in record else b""
    return len(data) if isinstance(data, bytes) else 0


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(reason: str, limit: int = 300) -> str:
    """The last meaningful line of a node's error (a remote traceback ends with the exception),
    without terminal colours, at most ``limit`` characters."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(reason)).splitlines() if ln.strip()]
    text = lines[-1] if lines else "unknown error"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def whole_number(value: Any) -> int | None:
    """``value`` of a Flower run config or node config as an integer: an int, a whole float
    (``3.0``) or a number in quotes (``'4'``; Flower passes values through as typed); None for
    anything else (a bool, ``2.7``, ``'abc'``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


__all__ = ["BLOB", "CONTROL", "EVALUATE", "PAYLOAD", "QUERY", "TRAIN", "one_line", "payload_to_records",
           "records_to_payload", "whole_number"]
