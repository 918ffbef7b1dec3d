"""The display of progress inside a federated round (a listener of :mod:`rafl.federation.progress`).

On a terminal: a second tqdm bar under the engine's bar over rounds, ``round 3: 1/2 clients,
client 7 epoch 2/2``, updated as clients finish and epochs start, and gone when the round ends.
Elsewhere (a log file, a CI job, a pipe): no bar, so the log is not flooded with carriage-return
updates; instead one plain line on the stream whenever at least ``interval_s`` seconds (default
30) passed since the round started or since the last line, e.g. ``round 3/10: 1/2 clients done,
client 7 in local epoch 2/2 (95 s into the round)``. A round shorter than that prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from rafl.federation.progress import listening


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

    # ------------------------------------------------------------------ events
    def __call__(self, event: str, info: dict[str, Any]) -> None:
        if event == "round":
            self.round, self.rounds, self.clients = info["round"], info["rounds"], info["clients"]
            self.done, self.client, self.epoch, self.phase = 0, None, None, "training"
            self.t_round = self.t_line = self.clock()
            if self.terminal:
                self._open_bar()
        elif event == "client":
            self.client, self.epoch = info["client"], None
        elif event == "epoch":
            self.epoch = (info["epoch"], info["epochs"])
        elif event == "client_done":
            self.done += 1
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
    def status(self) -> str:
        """The current state as one phrase: ``1/2 clients done, client 7 in local epoch 2/2``."""
        text = f"{self.done}/{self.clients} clients done"
        if self.client is not None:
            text += f", client {self.client}"
            if self.epoch is not None:
                text += f" in local epoch {self.epoch[0]}/{self.epoch[1]}"
        elif self.phase != "training":
            text += f", {self.phase}"
        return text

    def _open_bar(self) -> None:
        from tqdm.auto import tqdm

        self._close_bar()
        self.bar = tqdm(total=self.clients, desc=f"round {self.round} clients", position=1, leave=False,
                        file=self.stream, dynamic_ncols=True)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _show(self) -> None:
        if self.terminal:
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
    import contextlib

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
