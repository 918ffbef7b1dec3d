"""The display of progress inside a federated round (a listener of :mod:`rafl.federation.events`).

On a terminal: a second tqdm bar under the engine's bar over rounds, ``round 3 clients: 1/2,
client 7 epoch 2/2 batch 13/40, about 50 s left``, updated as clients finish and batches run, and
gone when the round ends. Elsewhere (a log file, a CI job, a pipe): no bar, so the log is not
flooded with carriage-return updates; instead one plain line on the stream whenever at least
``interval_s`` seconds (default 30) passed since the round started or since the last line, e.g.
``round 3/10: 1/2 clients done, client 7 in local epoch 2/2, batch 13/40, about 50 s left in the
round (95 s into the round)``. A round shorter than that prints nothing.

The time left is counted in local training batches: the batches still to run of the clients in
training, plus, for the clients not started yet, the mean batch count of those seen this round,
divided by the rate of batches so far this round (all workers together). Once per display, when
the first round has run :data:`ESTIMATE_AFTER_S` seconds of batches (or its first client is done),
one line says what the rounds should take and how to make them shorter.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm

from rafl.federation.events import listening

#: seconds of local training batches after which the first round's estimate is printed
ESTIMATE_AFTER_S = 5.0

#: how to make the rounds shorter, in the estimate's line
SHORTER = ("shorter: --set engine.rounds=N, --set algorithm.local_epochs=1, or fewer clients per round "
           "(--set engine.clients_per_round=0.5)")


def fmt_seconds(s: float) -> str:
    """``42 s``, ``3.5 min``, ``1.2 h``."""
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


class RoundProgress:
    """Listener ``(event, info)`` that shows clients done / sampled and the current client's local
    epoch (see the module doc).

    Args:
        stream: where to write (default ``sys.stderr``, as tqdm).
        interval_s: off a terminal, the least seconds between two lines (>= 0).
        terminal: force the terminal (True) or log (False) display; default: ``stream.isatty()``.
        clock: seconds as ``time.monotonic`` (a test passes its own).
    """

    def __init__(self, stream: TextIO | None = None, *, interval_s: float = 30.0, terminal: bool | None = None,
                 clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = float(interval_s)
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty()) if terminal is None else terminal
        self.clock = clock
        self.bar = None
        self.round = self.rounds = self.clients = self.done = 0
        self.client: int | None = None
        self.epoch: tuple[int, int] | None = None
        self.phase = "training"
        self.t_round = self.t_line = 0.0
        self.active: dict[Any, tuple[int, int, int, int | None]] = {}  # client -> epoch, epochs, batch, batches
        self.totals: dict[Any, int] = {}  # client -> its batches over all local epochs (this round)
        self.batches_done = 0
        self.t_batch: float | None = None  # the round's first batch
        self.estimated = False
        self.t_bar = float("-inf")

    # ------------------------------------------------------------------ events
    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "round":
            self.round, self.rounds, self.clients = info["round"], info["rounds"], info["clients"]
            self.done, self.client, self.epoch, self.phase = 0, None, None, "training"
            self.t_round = self.t_line = self.clock()
            self.active, self.totals, self.batches_done, self.t_batch = {}, {}, 0, None
            if self.terminal:
                self._open_bar()
        elif event == "client":
            self.client, self.epoch = info["client"], None
        elif event == "epoch":
            self.epoch = (info["epoch"], info["epochs"])
        elif event == "batch":
            who = info.get("client", self.client)
            self.active[who] = (info["epoch"], info["epochs"], info["batch"], info["batches"])
            if info["batches"]:
                self.totals[who] = info["epochs"] * info["batches"]
            self.batches_done += 1
            if self.t_batch is None:
                self.t_batch = self.clock()
            self._estimate()
            self._show(batch=True)
            return
        elif event == "client_done":
            self.done += 1
            self.active.pop(info.get("client"), None)
            self._estimate(client_done=True)
            self.client, self.epoch = None, None
            if self.bar is not None:
                self.bar.update(1)
        elif event == "trained":  # a runner whose clients trained elsewhere reports them here at once
            if self.bar is not None and info["done"] > self.done:
                self.bar.update(info["done"] - self.done)
            self.done = max(self.done, info["done"])
            self.client, self.epoch, self.phase = None, None, "aggregating"
        elif event == "evaluate":
            self.phase = f"evaluating {info['clients']} clients"
        elif event == "round_end":
            self._close_bar()
            return
        else:
            return
        self._show()

    def close(self) -> None:
        """Remove the bar (a run that stopped inside a round)."""
        self._close_bar()

    # ------------------------------------------------------------------ output
    def seconds_left(self) -> float | None:
        """The round's local training time left (module doc), or None before two batches ran."""
        if self.t_batch is None or self.batches_done < 2 or not self.totals:
            return None
        elapsed = self.clock() - self.t_batch
        if elapsed <= 0:
            return None
        rate = (self.batches_done - 1) / elapsed
        left = 0
        for who, (epoch, epochs, batch, batches) in self.active.items():
            if batches:
                left += max(0, epochs * batches - ((epoch - 1) * batches + batch))
        waiting = max(0, self.clients - self.done - len(self.active))
        left += waiting * sum(self.totals.values()) / len(self.totals)
        return left / rate

    def status(self) -> str:
        """The current state as one phrase: ``1/2 clients done, client 7 in local epoch 2/2``
        (``, batch 13/40, about 50 s left in the round`` once batches are reported)."""
        text = f"{self.done}/{self.clients} clients done"
        if self.client is not None:
            text += f", client {self.client}"
            if self.epoch is not None:
                text += f" in local epoch {self.epoch[0]}/{self.epoch[1]}"
            if self.client in self.active:
                _, _, batch, batches = self.active[self.client]
                text += f", batch {batch}/{batches or '?'}"
        elif self.active and self.phase == "training":  # clients training in worker processes
            text += ", " + ", ".join(f"client {who} epoch {e}/{es} batch {b}/{bs or '?'}"
                                     for who, (e, es, b, bs) in sorted(self.active.items(), key=str))
        elif self.phase != "training":
            text += f", {self.phase}"
        left = self.seconds_left() if self.phase == "training" else None
        if left is not None:
            text += f", about {fmt_seconds(left)} left in the round"
        return text

    def _estimate(self, client_done: bool = False) -> None:
        """Once: what the rounds should take (this round so far + its time left, times the rounds
        still to run) and how to make them shorter (module doc)."""
        if self.estimated or self.t_batch is None:
            return
        if not client_done and self.clock() - self.t_batch < ESTIMATE_AFTER_S:
            return
        left = self.seconds_left()
        if left is None:
            return
        self.estimated = True
        per_round = self.clock() - self.t_round + left
        rounds = self.rounds - self.round + 1
        line = (f"rounds: about {fmt_seconds(per_round)} of local training per round (from round {self.round}'s "
                f"first batches), so about {fmt_seconds(per_round * rounds)} for the {rounds} round"
                f"{'s' if rounds != 1 else ''} to run, plus evaluation; {SHORTER}")
        if self.terminal:
            tqdm.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def _open_bar(self) -> None:
        self._close_bar()
        self.bar = tqdm(total=self.clients, desc=f"round {self.round} clients", position=1, leave=False,
                        file=self.stream, dynamic_ncols=True)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _show(self, batch: bool = False) -> None:
        if self.terminal:
            now = self.clock()
            if batch and now - self.t_bar < 0.2:  # a bar redrawn at most 5 times a second for batches
                return
            self.t_bar = now
            if self.bar is not None:
                self.bar.set_postfix_str(self.status().split(", ", 1)[1] if ", " in self.status() else "")
            return
        now = self.clock()
        if now - self.t_line < self.interval_s:
            return
        self.t_line = now
        self.stream.write(f"round {self.round}/{self.rounds}: {self.status()} ({now - self.t_round:.0f} s into "
                          "the round)\n")
        self.stream.flush()





def round_progress(enabled: bool = True, **kwargs: Any):
    """Context manager: a :class:`RoundProgress` listening for the block when ``enabled`` (the
    commands' ``--progress``), its bar removed at the end however the block ends."""
    @contextlib.contextmanager
    def _cm():
        if not enabled:
            yield None
            return
        display = RoundProgress(**kwargs)
        try:
            with listening(display):
                yield display
        finally:
            display.close()

    return _cm()
__all__ = ["RoundProgress", "round_progress"]
