"""The pydantic base of rafl's validated documents (run configs, device profiles).

It sits at the floor of :mod:`rafl.io` and :mod:`rafl.errors`, so every layer above may derive its
documents from it.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _accepts_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_accepts_bool(a) for a in get_args(annotation))


#: the largest magnitude of an integer in a validated document (every integer is exact as a float)
MAX_INT = 2**53


class NoBoolNumbers(BaseModel):
    """A pydantic model whose number fields refuse booleans, NaN/Inf and integers beyond
    :data:`MAX_INT` in magnitude (run configs, device profiles): every integer field is bounded on
    both sides, whatever its own range says."""

    model_config = ConfigDict(allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic's lax mode reads ``True`` as 1 for int/float fields, and YAML turns ``yes``/``on``
        into ``True``: ``clients.n=yes`` would silently run one client. Booleans only where allowed."""
        items = value if isinstance(value, list | tuple) else [value]
        if any(type(v) is int and abs(v) > MAX_INT for v in items):
            raise ValueError("an integer of more than 53 bits; allowed: integers in -2**53..2**53"
                             + (" (in the list)" if items is value else ""))
        if any(isinstance(v, bool) for v in items) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and not _accepts_bool(field.annotation):
                raise ValueError("a boolean is not allowed here" + (" (in the list)" if items is value else ""))
        return value


__all__ = ["MAX_INT", "NoBoolNumbers"]
