"""Errors that rafl raises for bad user input.

Every check of user input (a file, a CLI option, a config field, a checkpoint, a payload) raises
:class:`UserInputError` with one line that names *where* (file and/or field), *what* was found and
*what is allowed*. The CLI turns it into that one line on stderr and exit status 2.
"""

from __future__ import annotations

import reprlib
import sys
from collections.abc import Iterable
from pathlib import Path


class RaflError(Exception):
    """Base class of rafl's own errors."""


class UserInputError(RaflError, ValueError):
    """Bad input from the user: a file, option, config field, checkpoint or payload.

    Args:
        message: what is wrong and what is allowed.
        source: the file (path) or object the input came from, if any.
        field: the field / option / key that is wrong, if any.

    ``str(err)`` is one line: ``"<source>: <field>: <message>"`` (parts that are None are omitted).
    """

    def __init__(self, message: str, *, source: str | Path | None = None, field: str | None = None):
        self.message = message
        self.source = None if source is None else str(source)
        self.field = field
        super().__init__(self.__str__())

    def __str__(self) -> str:  # one line, always
        parts = [p for p in (self.source, self.field) if p]
        text = ": ".join([*parts, self.message])
        return " ".join(text.split("\n"))


class DivergedError(UserInputError):
    """Training whose loss or weights became NaN/Inf (:func:`rafl.federation.training.check_finite_loss`):
    the field named is the learning rate (or regularizer) to lower. Raised by a server step (FedDF's
    distillation, FedTGP's prototypes, FedGH's header) the engine records it as a failed round
    instead of ending the run, since the uploads it trained on may be what diverged."""


class DuplicateKeyError(UserInputError):
    """A YAML mapping holds a key twice (:func:`rafl.io.load_yaml`); PyYAML would keep the last value.

    Attributes:
        key: the repeated key; line, first_line: 1-based lines of the repeat and of the first one.
    """

    def __init__(self, key: object, line: int, first_line: int, *, source: str | Path | None = None):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(f"duplicate key {brief(key)} at line {line} (first at line {first_line}); a mapping holds "
                         "each key once (YAML readers keep the last silently): keep one", source=source)


_WARNED: set[str] = set()


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr: valid input that will not give what the user likely
    wants (e.g. clients without test data). Never for errors (those raise UserInputError). Each
    message is printed once per command (``compare`` prepares the data once per method);
    :func:`reset_warnings` starts a new command."""
    if message in _WARNED:
        return
    _WARNED.add(message)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def reset_warnings() -> None:
    """Forget the warnings already printed (called when a CLI command starts)."""
    _WARNED.clear()


def brief(value: object, limit: int = 120) -> str:
    """A bounded ``repr(value)`` for an error message (:mod:`reprlib`: long strings, lists and
    mappings are cut with ``...``; a value of a hostile file is never printed whole)."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlevel = 60, 60, 3
    r.maxlist = r.maxtuple = r.maxdict = r.maxset = 8
    r.maxlong = 40
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown(value: object) -> str:
    """``repr(value)`` for an error message, plus a hint when YAML parsing changed what the user
    typed: ``yes``/``no``/``on``/``off``/``true``/``false`` become booleans and an empty value or
    ``~`` becomes null, so ``--set algorithm.label_prior=yes`` arrives as ``True``."""
    if isinstance(value, bool) or value is None:
        return (f"{value!r} (YAML reads yes/no/on/off/true/false as a boolean and an empty value or ~ as null; "
                "quote the value to pass it as text)")
    return brief(value)


def allowed(values: Iterable[object]) -> str:
    """Format allowed values for an error message: ``"one of 3, 5, 7"``."""
    vals = list(values)
    return "one of " + ", ".join(str(v) for v in vals)


def load_error_detail(err: Exception, limit: int = 200) -> str:
    """The first specific line of a ``load_state_dict`` error (torch's first line only says
    "Error(s) in loading state_dict for X:"; the details follow on tab-indented lines), e.g.
    ``size mismatch for blocks.0.conv.weight: copying a param with shape ...``."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    detail = next((ln for ln in lines[1:]), lines[0] if lines else err.__class__.__name__)
    return detail[:limit]


def yaml_error_detail(err: Exception, what: str = "YAML") -> str:
    """``"not valid YAML at line L, column C: <problem>"`` for a PyYAML error, from its problem
    mark (1-based line and column, as editors count), e.g. ``not valid YAML at line 3, column 8:
    mapping values are not allowed here``; ``"not valid YAML (not UTF-8 text)"`` for a
    ``UnicodeDecodeError``. ``what`` names the format (``"YAML/JSON"``)."""
    if isinstance(err, UnicodeDecodeError):
        return f"not valid {what} (not UTF-8 text: byte {err.start} cannot be decoded)"
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or getattr(err, "context", None) or err.__class__.__name__
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    if context and context != problem and getattr(err, "problem", None):
        problem = f"{problem} ({context}"
        ctx_mark = getattr(err, "context_mark", None)
        problem += f" at line {ctx_mark.line + 1})" if ctx_mark is not None else ")"
    return f"not valid {what}{where}: {problem}"
