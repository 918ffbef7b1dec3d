"""Click parameter types shared by the commands."""

from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """``click.FloatRange`` that also refuses NaN and infinity (``float("nan")`` passes every range
    comparison, so click lets ``--width-mult nan`` through)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number", param, ctx)
        return rv


#: ``--data-root``'s help, the same on every command that reads a dataset
DATA_ROOT_HELP = ("Where the dataset is: a folder or a .tar.gz of CIFAR-10/100 or FEMNIST (layouts: docs/data.md); "
                  "not needed for digits, which is embedded  [default: $RAFL_DATA_ROOT, else ~/.cache/rafl-data].")


def data_root_option(extra: str = ""):
    """The ``--data-root PATH`` option (parameter ``data_root``, a ``Path`` or None) with
    :data:`DATA_ROOT_HELP` plus ``extra`` (what it replaces on that command)."""
    from pathlib import Path

    return click.option("--data-root", "data_root", type=click.Path(path_type=Path), default=None,
                        metavar="PATH", help=DATA_ROOT_HELP + (f" {extra}" if extra else ""))
