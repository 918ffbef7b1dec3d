"""Flower's SuperNode with a configurable poll interval (``rafl flower-supernode``).

A SuperNode of flwr 1.42 (``flower-supernode``, :func:`flwr.supernode.start_client_internal.
start_client_internal`) asks the SuperLink for a message, and when there is none it sleeps 3 s
before it asks again; once it has handed a message to its ClientApp it checks for the reply every
0.5 s. Both intervals are literals in that function, with no option or environment variable. A
deployment round is two messages per node (train, then evaluate), and each waits up to one idle
poll after the ServerApp sent it.

:func:`run` is ``flower-supernode`` itself -- Flower's own argument parser, connection, node
state, Runtime API, heartbeats and authentication, unchanged -- with one change: the module's
``time`` is replaced by a :class:`PollClock` whose ``sleep`` waits at most ``poll_interval_s``
(every wait of that loop: the idle poll, the wait for a ClientApp's reply and for its content; an
interval above Flower's own leaves that wait as it is).
Each idle node then sends ``1 / poll_interval_s`` PullMessages requests a second, which the
SuperLink serves: a shorter wait is paid in CPU on the SuperLink's machine, and on a machine that
also runs the clients, in their time (``bench/flower_overhead.py``: with 2 SuperNodes on 2 cores,
0.1 s and a 0.02 s SuperExec poll made rounds slower than 0.2 s and 0.1 s).
:class:`~rafl.stages.flower.fleet.LocalFleet` uses 0.2 s; for a large fleet Flower's own 3 s
(``flower-supernode``) may be the right choice.

The replaced name is checked before it is replaced: another flwr whose SuperNode loop has no
module-level ``time`` raises :class:`RuntimeError` instead of silently polling at Flower's pace.
"""

from __future__ import annotations

import signal
import sys
import time
import types
from collections.abc import Sequence

from rafl.errors import UserInputError

#: the default of ``rafl flower-supernode --poll-interval``, in seconds (Flower's own: 3 s idle, 0.5 s for a reply)
DEFAULT_POLL_INTERVAL_S = 0.2
#: the smallest interval accepted, in seconds (below it the poll costs more than it saves)
MIN_POLL_INTERVAL_S = 0.01


class PollClock:
    """A stand-in for the :mod:`time` module whose :meth:`sleep` waits at most ``poll_interval_s``
    seconds; every other attribute is :mod:`time`'s own.

    Args:
        poll_interval_s: the longest sleep, in seconds (> 0).
    """

    def __init__(self, poll_interval_s: float):
        self.poll_interval_s = float(poll_interval_s)

    def sleep(self, seconds: float) -> None:
        """``time.sleep(min(seconds, poll_interval_s))``."""
        time.sleep(min(float(seconds), self.poll_interval_s))

    def __getattr__(self, name: str):
        return getattr(time, name)


def check_poll_interval(poll_interval_s: float) -> float:
    """``poll_interval_s`` as a float.

    Raises:
        UserInputError: not a finite number >= :data:`MIN_POLL_INTERVAL_S` (field ``--poll-interval``).
    """
    value = float(poll_interval_s)
    if not MIN_POLL_INTERVAL_S <= value < float("inf"):
        raise UserInputError(f"is {poll_interval_s!r} s; allowed: a number of seconds >= {MIN_POLL_INTERVAL_S:g}",
                             field="--poll-interval")
    return value


def patch_poll(poll_interval_s: float) -> types.ModuleType:
    """Make Flower's SuperNode loop (``flwr.supernode.start_client_internal``) sleep at most
    ``poll_interval_s`` seconds between polls; returns that module.

    Raises:
        UserInputError: a bad ``poll_interval_s`` (:func:`check_poll_interval`).
        RuntimeError: the installed flwr's SuperNode loop does not sleep through its module's
            ``time`` (another flwr than 1.42): nothing is changed.
    """
    interval = check_poll_interval(poll_interval_s)
    import flwr.supernode.start_client_internal as loop  # noqa: PLC0415 - flwr: optional (rafl[flower])

    if not isinstance(getattr(loop, "time", None), (types.ModuleType, PollClock)):
        raise RuntimeError("flwr.supernode.start_client_internal has no module-level `time` (not flwr 1.42's "
                           "SuperNode loop): use Flower's own flower-supernode")
    loop.time = PollClock(interval)
    return loop


def run(args: Sequence[str], poll_interval_s: float = DEFAULT_POLL_INTERVAL_S) -> None:
    """Run ``flower-supernode ARGS`` in this process (until SIGINT/SIGTERM, as Flower's command),
    polling the SuperLink every ``poll_interval_s`` seconds when idle.

    Args:
        args: ``flower-supernode``'s own arguments (``--superlink``, ``--insecure`` or
            ``--root-certificates``, ``--auth-supernode-private-key``, ``--node-config``, ...).
        poll_interval_s: the longest sleep of the SuperNode's loop, in seconds.

    Raises:
        UserInputError: a bad ``poll_interval_s``.
        RuntimeError: see :func:`patch_poll`.
    """
    patch_poll(poll_interval_s)
    from flwr.supernode.cli.flower_supernode import flower_supernode  # noqa: PLC0415 - as above

    # Flower's own signal handling, as under `flower-supernode`: its handler puts back the handler it
    # found, so the rafl CLI's SIGTERM handler (SystemExit) would run on a second SIGTERM inside
    # Flower's shutdown and leave the process waiting on its Runtime API thread
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["flower-supernode", *args]
    flower_supernode()


__all__ = ["DEFAULT_POLL_INTERVAL_S", "MIN_POLL_INTERVAL_S", "PollClock", "check_poll_interval", "patch_poll", "run"]
