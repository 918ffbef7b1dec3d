"""FL methods, one module per method, registered by name, and the bases families of methods share
(:mod:`~rafl.federation.algorithms.prototype_family`: FedProto, FedTGP, FD).

Importing this package imports every module in it, so each module's ``@register`` runs and
:func:`get_algorithm` knows every method (new methods need no edit here: add a module).
"""

from __future__ import annotations

import importlib
import pkgutil

from rafl.federation.algorithms.base import (
    ALGORITHMS,
    DEPLOYED,
    Accuracy,
    Algorithm,
    ClientContext,
    ClientInfo,
    ServerContext,
    get_algorithm,
    register,
    reported_accuracies,
)

for _mod in pkgutil.iter_modules(__path__):
    if _mod.name != "base" and not _mod.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_mod.name}")

__all__ = ["ALGORITHMS", "DEPLOYED", "Accuracy", "Algorithm", "ClientContext", "ClientInfo", "ServerContext", "get_algorithm",
           "register", "reported_accuracies"]
