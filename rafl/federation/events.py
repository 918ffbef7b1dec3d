"""Progress events from inside a federated round (the producer side; :mod:`rafl.reports.progress` displays them).

The engine and the local-training loops call :func:`report` at a few points of a round; nothing
happens unless a listener is installed with :func:`listening` (the CLI's display,
:class:`rafl.reports.progress.RoundProgress`). Events, with their keyword fields:

- ``round``: a round starts; ``round`` (1-based), ``rounds`` (the run's total), ``clients``
  (how many sampled clients train, dropouts excluded).
- ``client``: a client's local training starts in this process; ``client`` (its id).
- ``epoch``: a local epoch starts; ``epoch`` (1-based), ``epochs``.
- ``batch``: a local training step starts; ``batch`` (1-based), ``batches`` (the epoch's batches,
  None for a loader without a length), ``epoch``, ``epochs``; from a worker process (forwarded by
  :class:`rafl.federation.workers.WorkerClients`) also ``client``.
- ``client_done``: that client's local training ended; ``client``.
- ``trained``: the round's client runner returned; ``done`` (clients whose upload arrived). A
  runner whose clients train elsewhere reports no ``client``/``epoch`` events here, only this
  one (worker processes forward their ``batch`` events; Flower ClientApps nothing).
- ``evaluate``: evaluation starts; ``clients`` (how many are evaluated).
- ``round_end``: the round is checkpointed; ``round``.

A listener is a plain callable ``listener(event: str, info: dict)``; it must not raise (an
exception in it propagates into the round). Listeners are process-wide (not per thread: Flower's
Simulation Runtime runs the engine in another thread of the same process).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Listener = Callable[[str, dict[str, Any]], None]

_LISTENERS: list[Listener] = []


def report(event: str, **info: Any) -> None:
    """Send ``event`` with ``info`` to every installed listener (nothing when there is none)."""
    for listener in tuple(_LISTENERS):
        listener(event, info)


def silence() -> None:
    """Remove every listener (a forked worker process: the display it inherited is the run's,
    which its own events would overwrite with stale state; the run reports its clients)."""
    _LISTENERS.clear()


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    """Install ``listener`` for the block (None: nothing is installed)."""
    if listener is None:
        yield
        return
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


__all__ = ["Listener", "listening", "report"]
