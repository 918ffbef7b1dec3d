"""The fine-tuned rows of a comparison (``<method>-ft``): a finished global-model method's final
broadcast fine-tuned and scored on every client (:func:`rafl.federation.finetune.finetune_evaluate`),
kept in the method's run dir so a resumed comparison reuses it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rafl.federation.engine import CHECKPOINT, Federation
from rafl.federation.finetune import finetune_evaluate
from rafl.federation.payload import Payload
from rafl.federation.store import load_state
from rafl.io import atomic_write_json
from rafl.reports.compare import FINETUNED, finetuned_clients, summarize_finetuned


def finetuned_row(fed: Federation, seed: int, rounds: int, run_dir: Path, base_row: dict[str, Any],
                   table: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``<method>-ft`` row of a finished global-model method: the final broadcast (its
    checkpoint) fine-tuned and scored on every client (:func:`rafl.federation.finetune.finetune_evaluate`),
    kept in ``run_dir/finetuned.json`` so a resumed comparison reuses it."""
    path = run_dir / FINETUNED
    if path.is_file():
        try:
            kept = json.loads(path.read_text())
            if kept.get("rounds") == rounds:
                return summarize_finetuned(base_row, kept["clients"], float(kept["seconds"]), table)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # damaged: fine-tune again
    ck = load_state(run_dir / CHECKPOINT)
    broadcast = Payload(ck["broadcast_tensors"], json.loads(ck["broadcast_meta"]))
    t0 = time.perf_counter()
    clients = finetuned_clients(finetune_evaluate(fed, seed, rounds + 1, broadcast))
    seconds = time.perf_counter() - t0
    atomic_write_json(path, {"rounds": rounds, "seconds": seconds, "clients": clients})
    return summarize_finetuned(base_row, clients, seconds, table)
