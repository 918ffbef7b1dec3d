"""The names of a run's accuracy figures, written once for every module that writes or reads them.

A model ``m`` is named by an :class:`~rafl.federation.algorithms.base.Accuracy`'s prefix
(:data:`DEPLOYED_MODEL`, ``model``: the model a client deploys; ``proto``, ``knowledge``, ...), with
:data:`GLOBAL_SUFFIX` when it was scored on the held-out global test set (``model@global``). Its
figures (:class:`ModelKeys`) are, by the record that holds them:

- the evaluation contract (:meth:`Algorithm.evaluate <rafl.federation.algorithms.base.Algorithm.evaluate>`,
  one client): ``m.correct``, ``m.total``;
- a round's record (``metrics.jsonl``, ``metrics.csv``, ``summary.json``'s ``final``:
  :func:`rafl.federation.engine.summarize_eval`): ``m.acc_mean_over_clients``,
  ``m.acc_sample_weighted``, ``m.acc_std_over_clients``, and where some clients have not trained
  yet ``m.acc_untrained_sample_weighted``, ``m.acc_all_sample_weighted``;
- one client's accuracy (``summary.json``'s ``clients``, the per-client table, ``new_clients``):
  ``m.acc``, with :data:`TEST_SAMPLES` / :data:`GLOBAL_TEST_SAMPLES`; after a local fine-tune
  ``m.acc_ft``;
- a row of ``rafl compare``'s table (:mod:`rafl.reports.compare`) and the held-out clients' means
  (:func:`rafl.federation.new_clients.new_clients_summary`): ``m.acc_mean``, ``m.acc_std``,
  ``m.acc_pooled``, ``m.acc_pooled_se``, ``m.acc_mean_last3``, ``m.acc_ft_mean``; the held-out
  clients' figures in a comparison's row are those of the pseudo-models ``new`` and ``new-ft``
  (:data:`NEW_CLIENTS`, :data:`NEW_CLIENTS_FT`).

The files keep these names as written here (tests check them as literal strings). This module
imports nothing of rafl, so the engine, the reports and the CLI all take the names from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

#: the deployed model's name (:data:`rafl.federation.algorithms.base.DEPLOYED`'s prefix)
DEPLOYED_MODEL = "model"

#: the suffix of a model's name when it is scored on the held-out global test set
#: (``model@global.correct``): the global-accuracy protocol beside the personalized one (the
#: client's own test split, ``model.correct``)
GLOBAL_SUFFIX = "@global"

#: a client record's test-split size (``summary.json``'s ``clients``, ``new_clients``)
TEST_SAMPLES = "test_samples"
#: a client record's global-test-set size (the same images for every client)
GLOBAL_TEST_SAMPLES = "global_test_samples"

_CORRECT, _TOTAL = ".correct", ".total"
_MEAN_OVER_CLIENTS = ".acc_mean_over_clients"
_ACC = ".acc"


@dataclass(frozen=True)
class ModelKeys:
    """The record keys of one model (module docstring), e.g. ``ModelKeys("proto").acc ==
    "proto.acc"``; :data:`MODEL` is the deployed model's."""

    model: str

    @property
    def on_global(self) -> ModelKeys:
        """The same model scored on the held-out global test set (``model@global``)."""
        return ModelKeys(self.model + GLOBAL_SUFFIX)

    # the evaluation contract
    @property
    def correct(self) -> str:
        return self.model + _CORRECT

    @property
    def total(self) -> str:
        return self.model + _TOTAL

    # a round's record
    @property
    def acc_mean_over_clients(self) -> str:
        """The unweighted mean of the clients' accuracies."""
        return self.model + _MEAN_OVER_CLIENTS

    @property
    def acc_sample_weighted(self) -> str:
        """Sum correct / sum total over the clients."""
        return f"{self.model}.acc_sample_weighted"

    @property
    def acc_std_over_clients(self) -> str:
        """The population std of the clients' accuracies."""
        return f"{self.model}.acc_std_over_clients"

    @property
    def acc_untrained_sample_weighted(self) -> str:
        """Sum correct / sum total over the clients that have not trained yet."""
        return f"{self.model}.acc_untrained_sample_weighted"

    @property
    def acc_all_sample_weighted(self) -> str:
        """Sum correct / sum total over every client's test samples."""
        return f"{self.model}.acc_all_sample_weighted"

    # one client
    @property
    def acc(self) -> str:
        return self.model + _ACC

    @property
    def acc_ft(self) -> str:
        """After one local fine-tune (the new-clients protocol)."""
        return f"{self.model}.acc_ft"

    # a comparison's row, the held-out clients' means
    @property
    def acc_mean(self) -> str:
        return f"{self.model}.acc_mean"

    @property
    def acc_std(self) -> str:
        return f"{self.model}.acc_std"

    @property
    def acc_pooled(self) -> str:
        """Correct / test samples of all clients together."""
        return f"{self.model}.acc_pooled"

    @property
    def acc_pooled_se(self) -> str:
        """The binomial standard error of :attr:`acc_pooled`."""
        return f"{self.model}.acc_pooled_se"

    def acc_mean_last(self, n: int) -> str:
        """The mean of the last ``n`` evaluated rounds' :attr:`acc_mean_over_clients`."""
        return f"{self.model}.acc_mean_last{n}"

    @property
    def acc_ft_mean(self) -> str:
        return f"{self.model}.acc_ft_mean"


#: the deployed model's keys (``model.acc``, ``model.acc_mean_over_clients``, ...)
MODEL = ModelKeys(DEPLOYED_MODEL)
#: a comparison row's figure of the held-out clients (the new-clients protocol) as deployed,
#: ``new.acc_mean`` (:attr:`MODEL`'s ``acc_mean`` in ``new_clients``)
NEW_CLIENTS = ModelKeys("new")
#: the same after one local fine-tune, ``new-ft.acc_mean`` (``new_clients``' ``model.acc_ft_mean``)
NEW_CLIENTS_FT = ModelKeys("new-ft")


def counted_models(counts: Iterable[str]) -> list[str]:
    """The models with a ``m.correct`` among the keys ``counts`` (evaluation-contract counts), sorted."""
    return sorted({k[:-len(_CORRECT)] for k in counts if k.endswith(_CORRECT)})


def evaluated_models(record: Iterable[str]) -> list[str]:
    """The models with a ``m.acc_mean_over_clients`` among a round record's keys, sorted ([] for a
    round that was not evaluated)."""
    return sorted({k[:-len(_MEAN_OVER_CLIENTS)] for k in record if k.endswith(_MEAN_OVER_CLIENTS)})


def is_client_accuracy(key: str) -> bool:
    """Whether ``key`` is one client's accuracy of a model (``m.acc``)."""
    return key.endswith(_ACC)


def is_count(key: str) -> bool:
    """Whether ``key`` is an evaluation-contract count (``m.correct`` or ``m.total``)."""
    return key.endswith((_CORRECT, _TOTAL))


def global_count(key: str) -> str | None:
    """The count ``key`` (``m.correct`` / ``m.total``) of the same model scored on the held-out
    global test set (``m@global.correct`` / ``m@global.total``); None for a key that is no count."""
    for suffix in (_CORRECT, _TOTAL):
        if key.endswith(suffix):
            return key[:-len(suffix)] + GLOBAL_SUFFIX + suffix
    return None


def totals(counts: Mapping[str, float]) -> dict[str, float]:
    """Model name -> its test-set size (``m.total``) in one client's evaluation-contract ``counts``,
    in their order."""
    return {k[:-len(_TOTAL)]: v for k, v in counts.items() if k.endswith(_TOTAL)}


def model_counts(counts: Mapping[str, float]) -> Iterator[tuple[ModelKeys, float, float]]:
    """``(keys, correct, total)`` of every model in one client's evaluation-contract ``counts``, in
    their order."""
    for key, correct in counts.items():
        if key.endswith(_CORRECT):
            m = ModelKeys(key[:-len(_CORRECT)])
            yield m, correct, counts[m.total]


def client_accuracies(counts: Mapping[str, float]) -> dict[str, float | None]:
    """``m.acc`` -> correct / total (None for an empty test set) of every model in one client's
    evaluation-contract ``counts``, in their order."""
    return {m.acc: correct / total if total else None for m, correct, total in model_counts(counts)}


__all__ = ["DEPLOYED_MODEL", "GLOBAL_SUFFIX", "GLOBAL_TEST_SAMPLES", "MODEL", "ModelKeys", "NEW_CLIENTS", "NEW_CLIENTS_FT",
           "TEST_SAMPLES", "client_accuracies", "counted_models", "evaluated_models", "global_count",
           "is_client_accuracy", "is_count", "model_counts", "totals"]
