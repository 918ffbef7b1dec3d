"""Hyperparameter models: every FL method declares its hyperparameters as a pydantic model --
types, ranges and defaults in one place -- and :meth:`Hyperparameters.check` turns a run config's
``algorithm`` section into the method's resolved hyperparameters.

A number field reads what YAML gives: ``1e-3`` (a string to YAML 1.1) is parsed; an integer field
takes ``2.0`` as 2 but refuses 2.5; a boolean is never a number and every float is finite. Range
errors name the bound (``a number > 0``) or, above the upper bound, the field's ``description``
(its whole range, e.g. ``a number in [0, 1)``)::

    class FedProxHparams(LocalTraining):
        mu: float = bounded(0.01, ge=0)   # the proximal weight

Errors are :class:`~rafl.errors.UserInputError` s naming ``algorithm.<key>`` and the value as
given, e.g. ``algorithm.lr: is 'abc'; allowed: a number``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from rafl.errors import UserInputError, shown
from rafl.federation.catalog import unknown_hyperparameters

#: the largest ``*_dim`` hyperparameter (a layer width; as ``clients.feature_dim``'s bound)
MAX_DIM = 4096

#: the local optimizers of ``algorithm.optimizer`` (:func:`rafl.federation.training.make_optimizer`)
OPTIMIZERS = ("sgd", "adam")

#: The local learning rate of NAS subnets (``clients.models: nas``), every method's default
#: ``algorithm.lr``: a subnet is fine-tuned from the trained supernet's weights and has BatchNorm.
SUBNET_LR = 0.05

#: The local learning rate of a model group (``clients.models`` other than ``nas``: the htfe
#: groups, zoo names, plug-ins) when none is given (:func:`with_group_lr`): a group trains from
#: scratch and may have no BatchNorm (cnn3-small, cnn4-small). On digits pathological 2/10 with 20
#: htfe-tiny clients, Standalone and FD diverged at :data:`SUBNET_LR` (momentum 0.9) on 3/3 seeds (FD)
#: and 1/3 (Standalone) within 10 rounds, and none did at 0.01 -- HtFLlib's default and that of
#: ``bench/htfl_bench.py``.
GROUP_LR = 0.01

#: a field's ``json_schema_extra`` flag: a violated lower bound names the whole range too
_WHOLE_RANGE = "rafl_whole_range"


def _refuse(value: Any, allowed: str) -> PydanticCustomError:
    return PydanticCustomError("rafl_hparam", "{message}", {"message": f"is {shown(value)}; allowed: {allowed}"})


def _as_float(value: Any) -> float:
    """A number as YAML hands it over (numeric strings parsed), finite; never a boolean."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value) if isinstance(value, str) else value
        if not isinstance(number, int | float):
            raise ValueError
        number = float(number)
    except (TypeError, ValueError, OverflowError):
        raise _refuse(value, "a number") from None
    if not math.isfinite(number):
        raise _refuse(value, "a finite number")
    return number


def _as_int(value: Any) -> int:
    """A whole number as YAML hands it over (``2.0`` and ``"2"`` are 2); never a boolean."""
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value) if isinstance(value, str) else value
        if not isinstance(number, int | float) or float(number) != int(number):
            raise ValueError
        return int(number)
    except (TypeError, ValueError, OverflowError):
        raise _refuse(value, "an integer") from None


def _as_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(value, "true or false")
    return value


def _as_text(value: Any) -> str:
    if not isinstance(value, str):
        raise _refuse(value, "text")
    return value


def choice(*values: str) -> Any:
    """A text field allowing one of ``values`` (the error lists them in this order)."""

    def check(value: Any) -> str:
        if value not in values:
            raise _refuse(value, ", ".join(values))
        return value

    return Annotated[str, BeforeValidator(check)]


#: number field types: YAML's numbers, checked (use with :func:`bounded` for ranges)
Float = Annotated[float, BeforeValidator(_as_float)]
Int = Annotated[int, BeforeValidator(_as_int)]
Bool = Annotated[bool, BeforeValidator(_as_bool)]
Text = Annotated[str, BeforeValidator(_as_text)]
Optimizer = choice(*OPTIMIZERS)


def bounded(default: Any, *, description: str | None = None, whole_range: bool = False, **bounds: Any) -> Any:
    """A field with ``default`` and pydantic bounds (``gt``/``ge``/``lt``/``le``). ``description``:
    the allowed range as an error above the upper bound states it; ``whole_range``: below the lower
    bound too (else that error names the lower bound alone)."""
    return Field(default, description=description, json_schema_extra={_WHOLE_RANGE: True} if whole_range else None,
                 **bounds)


_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


class Hyperparameters(BaseModel):
    """The base of every method's hyperparameter model (see the module docstring). Keys are the
    fields' aliases where given (``lambda``, a Python keyword, is the field ``lambda_``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    @classmethod
    def keys(cls) -> list[str]:
        """The hyperparameter names, in declaration order."""
        return [f.alias or name for name, f in cls.model_fields.items()]

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """``name -> default``, in declaration order."""
        return {f.alias or name: f.default for name, f in cls.model_fields.items()}

    @classmethod
    def check(cls, given: Mapping[str, Any], method: str = "") -> dict[str, Any]:
        """The defaults merged with ``given``, checked: ``name -> value`` in declaration order.

        Raises:
            UserInputError: an unknown key (all of them listed, with the allowed ones), a value of
                the wrong type or out of range, naming ``algorithm.<key>``.
        """
        keys = cls.keys()
        unknown = sorted(set(given) - set(keys))
        if unknown:
            raise unknown_hyperparameters(unknown, method, keys)
        try:
            model = cls.model_validate(dict(given))
        except ValidationError as err:
            raise cls._user_error(err, given) from None
        return model.model_dump(by_alias=True)

    @classmethod
    def _user_error(cls, err: ValidationError, given: Mapping[str, Any]) -> UserInputError:
        first = err.errors(include_url=False)[0]
        key = str(first["loc"][0]) if first.get("loc") else ""
        info = next((f for name, f in cls.model_fields.items() if key in (name, f.alias)), None)
        key = (info.alias or key) if info is not None else key
        value = given.get(key, first.get("input"))
        kind = first["type"]
        if kind in _BOUNDS and info is not None:
            bound, op = _BOUNDS[kind]
            upper = bound in ("lt", "le")
            whole = bool((info.json_schema_extra or {}).get(_WHOLE_RANGE))  # type: ignore[union-attr]
            if info.description and (upper or whole):
                allowed = info.description
            else:
                number = "an integer" if info.annotation is int else "a number"
                limit = first["ctx"][bound]
                allowed = f"{number} {op} {int(limit) if float(limit).is_integer() else limit}"
            return UserInputError(f"is {shown(value)}; allowed: {allowed}", field=f"algorithm.{key}")
        if kind == "rafl_hparam":
            return UserInputError(first["msg"], field=f"algorithm.{key}" if key else "algorithm")
        return UserInputError(f"is {shown(value)}; {first['msg']}", field=f"algorithm.{key}" if key else "algorithm")


class LocalTraining(Hyperparameters):
    """Local-training hyperparameters every method accepts."""

    local_epochs: Int = bounded(2, ge=1)
    lr: Float = bounded(SUBNET_LR, gt=0)
    momentum: Float = bounded(0.9, ge=0, lt=1, description="a number in [0, 1)")
    weight_decay: Float = bounded(5e-4, ge=0)
    optimizer: Optimizer = "sgd"


def with_group_lr(hparams: dict[str, Any], given: Any, models: str) -> dict[str, Any]:
    """``hparams`` with ``lr`` = :data:`GROUP_LR` when the clients are a model group (``models`` not
    ``nas``), the method has a local ``lr`` and the user gave none (``given``: the keys set in the
    config or with ``--set``); otherwise unchanged."""
    if str(models).strip().lower() == "nas" or "lr" not in hparams or "lr" in set(given):
        return hparams
    return {**hparams, "lr": GROUP_LR}


def fraction(default: float) -> Any:
    """A share in (0, 1] (e.g. FedKD's SVD energy, RaFL's kept width)."""
    return bounded(default, gt=0, le=1, description="a fraction in (0, 1]", whole_range=True)


def width(default: int) -> Any:
    """A layer width in 0..:data:`MAX_DIM`; 0 = a default width."""
    return bounded(default, ge=0, le=MAX_DIM, description=f"an integer in 0..{MAX_DIM} (0 = a default width)")


__all__ = ["Bool", "Float", "GROUP_LR", "Hyperparameters", "Int", "LocalTraining", "MAX_DIM", "OPTIMIZERS", "Optimizer",
           "SUBNET_LR", "Text", "bounded", "choice", "fraction", "width", "with_group_lr"]
