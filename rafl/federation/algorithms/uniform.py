"""One size fits all: every client trains the same model, the largest the weakest device can run; FedAvg.

The control for "do tailored subnets pay?": instead of one subnet per device profile, the pipeline
gives every client one subnet (:func:`rafl.search.federation_search.uniform_arch`): among the subnets the
search found for the run's profiles, the most accurate (search accuracy on the server's validation
split; ties: fewer MACs) that meets the budgets of *every* client's profile (each profile's own cost
model). With nested budgets that is the weakest device's own subnet; when no profile's subnet
fits every other device (budgets that do not nest: the shipped cifar10 supernet's pi4 subnet is over
the Jetson Nano's latency budget), it is the subnet one evolution finds under every profile's
budgets at once (``search_subnets(common=True)``). With a model group
(``clients.models`` other than ``nas``) every client gets the group's smallest member (fewest
parameters; HeteroFL's narrowest rate for ``heterofl-cnn4``). Training and aggregation are FedAvg's
(McMahan et al., AISTATS 2017, Alg. 1: ``w <- sum_l (n_l / n) w_l``).

Bad input: no subnet meets every profile's budgets (e.g. a profile no subnet fits) -- one error
naming the profiles and the budgets violated, before round 1.

Where each step lives: the one subnet :func:`rafl.search.federation_search.uniform_arch` (called by
:func:`rafl.stages.prepare.prepare`), a model group's smallest member
:func:`rafl.federation.build.build_group_federation`; local training, aggregation and evaluation
:class:`FedAvg`'s (:meth:`FedAvg.client_update`, :meth:`FedAvg.server_aggregate`,
:meth:`FedAvg.evaluate`).
"""

from __future__ import annotations

from typing import ClassVar

from rafl.federation.algorithms.base import register
from rafl.federation.algorithms.fedavg import FedAvg


@register
class Uniform(FedAvg):
    """FedAvg on the one model that fits every client's device (module docstring)."""

    name: ClassVar[str] = "uniform"
    one_model_for_all: ClassVar[bool] = True
