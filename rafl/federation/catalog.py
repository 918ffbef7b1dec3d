"""The registered FL methods and their hyperparameter names, known without importing torch.

The methods live in :mod:`rafl.federation.algorithms`, one module per method, and importing any of
them imports torch (seconds). The commands check a method's name (``algorithm.name``, ``rafl
compare --algorithms``) and hint at hyperparameter names (``rafl federate --local-epochs``) before
that, from this catalogue: it reads the algorithm modules' *source* (``ast``, no import), so the
registry stays the one place a method is declared, and finds every class decorated with
``@register``, its ``name`` and the fields of its ``hparams_model`` (following base classes by
name through the package's modules, as Python's inheritance would). ``tests/test_method_catalog.py``
checks that it equals the registry (:data:`rafl.federation.algorithms.ALGORITHMS`).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from rafl.errors import UserInputError, allowed

#: the package whose modules register the methods (read as source, never imported here)
ALGORITHMS_DIR = Path(__file__).resolve().parent / "algorithms"

#: ``rafl compare``'s methods, in its table's order, when ``--algorithms`` is not given: RaFL, the
#: heterogeneous-model methods it is compared with, and the no-communication floor (Standalone)
DEFAULT_ALGORITHMS = ("rafl", "fedgh", "fedtgp", "fedproto", "lg-fedavg", "fd", "standalone")


def _classes() -> dict[str, ast.ClassDef]:
    """Every top-level class of the algorithm package's modules, by class name."""
    out: dict[str, ast.ClassDef] = {}
    for file in sorted(ALGORITHMS_DIR.glob("*.py")):
        for node in ast.parse(file.read_text(encoding="utf-8"), str(file)).body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, node)
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]


def _class_attr(classes: Mapping[str, ast.ClassDef], name: str, attr: str) -> ast.expr | None:
    """The value assigned to ``attr`` in class ``name`` or, as inheritance finds it, its bases."""
    node = classes.get(name)
    if node is None:
        return None
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == attr:
            return stmt.value
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in stmt.targets):
            return stmt.value
    for base in _base_names(node):
        found = _class_attr(classes, base, attr)
        if found is not None:
            return found
    return None


def _fields(classes: Mapping[str, ast.ClassDef], name: str) -> list[str]:
    """The hyperparameter names of the model class ``name``: its bases' first, then its own
    annotated fields (a field's ``alias=`` where given, as :meth:`Hyperparameters.keys`)."""
    node = classes.get(name)
    if node is None:
        return []
    out: list[str] = []
    for base in _base_names(node):
        out += [k for k in _fields(classes, base) if k not in out]
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if isinstance(stmt.annotation, ast.Subscript) and getattr(stmt.annotation.value, "id", "") == "ClassVar":
            continue
        if stmt.target.id.startswith("_") or stmt.target.id == "model_config":
            continue
        key = stmt.target.id
        if isinstance(stmt.value, ast.Call):
            key = next((kw.value.value for kw in stmt.value.keywords
                        if kw.arg == "alias" and isinstance(kw.value, ast.Constant)), key)
        if key not in out:
            out.append(key)
    return out


@lru_cache(maxsize=1)
def method_catalog() -> dict[str, tuple[str, ...]]:
    """Every registered method's name -> its hyperparameter names, in declaration order, read
    from the algorithm modules' source (no import)."""
    classes = _classes()
    out: dict[str, tuple[str, ...]] = {}
    for cname, node in classes.items():
        if not any(isinstance(d, ast.Name) and d.id == "register" for d in node.decorator_list):
            continue
        name = _class_attr(classes, cname, "name")
        model = _class_attr(classes, cname, "hparams_model")
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            continue
        out[name.value] = tuple(_fields(classes, model.id)) if isinstance(model, ast.Name) else ()
    return dict(sorted(out.items()))


def method_names() -> dict[str, str]:
    """Every registered method: lower-case name -> the name it is registered under (what
    :func:`rafl.config.read_run_config`'s ``methods`` takes)."""
    return {name.lower(): name for name in method_catalog()}


def hyperparameter_names() -> list[str]:
    """Every registered method's hyperparameter names (``local_epochs``, ``lr``, ``tau``, ...)."""
    return sorted({k for keys in method_catalog().values() for k in keys})


def check_method(name: str, field: str = "algorithm.name") -> str:
    """The registered name of method ``name`` (case-insensitive), as
    :func:`rafl.federation.algorithms.get_algorithm` finds it.

    Raises:
        UserInputError: an unknown name, listing the registered ones (naming ``field``).
    """
    key = name.strip().lower()
    names = method_names()
    if key not in names:
        raise UserInputError(f"unknown algorithm {name!r}; {allowed(sorted(names))}", field=field)
    return names[key]


def unknown_hyperparameters(unknown: list[str], method: str, keys: list[str]) -> UserInputError:
    """The error of hyperparameter(s) ``unknown`` that ``method`` (its hyperparameter names
    ``keys``) does not have, naming the first as ``algorithm.<key>``: one message wherever it is
    found (:func:`check_hyperparameter_names`, :meth:`Hyperparameters.check`)."""
    return UserInputError(f"unknown hyperparameter(s) {sorted(unknown)} for {method!r}; allowed: {sorted(keys)}",
                          field=f"algorithm.{sorted(unknown)[0]}")


def check_hyperparameter_names(method: str, given: Mapping[str, object]) -> None:
    """Every key of ``given`` (a run config's ``algorithm`` section without ``name``) is a
    hyperparameter of ``method`` (a registered name); their values are checked by the method's
    model when it loads.

    Raises:
        UserInputError: an unknown hyperparameter (:func:`unknown_hyperparameters`).
    """
    keys = list(method_catalog()[check_method(method)])
    unknown = [k for k in given if k not in keys]
    if unknown:
        raise unknown_hyperparameters(unknown, check_method(method), keys)


__all__ = ["DEFAULT_ALGORITHMS", "check_hyperparameter_names", "check_method", "unknown_hyperparameters",
           "hyperparameter_names", "method_catalog", "method_names"]
