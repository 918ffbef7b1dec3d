"""The names of a run's accuracy figures, written once for every module that writes or reads them.

A model ``m`` is named by an :class:`~rafl.federation.algorithms.base.Accuracy`'s prefix
(:data:`DEPLOYED_MODEL`, ``model``: the model a client deploys; ``proto``, ``knowledge``, ...), with
:data:`GLOBAL_SUFFIX` when it was scored on the held-out global test set (``model@global``). Its
figures (:class:`ModelKeys`) are, by the record that holds them:

- the evaluation contract (:meth:`Algorithm.evaluate <rafl.federation.algorithms.base.Algorithm.evaluate>`,
  one client): ``m.correct``, ``m.total``;
- a round's record (``metrics.jsonl``, ``metrics.csv``, ``summary.json``'s ``final``:
  :class:`rafl.federation.round_record.ModelAccuracy`, whose attributes are these names,
  :data:`ROUND_FIGURES`): ``m.acc_mean_over_clients``, ``m.acc_sample_weighted``,
  ``m.acc_std_over_clients``, and where some clients have not trained yet
  ``m.acc_untrained_sample_weighted``, ``m.acc_all_sample_weighted``;
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


class _Key:
    """A record key of a :class:`ModelKeys`: its model's name followed by ``suffix`` (read-only)."""

    def __init__(self, suffix: str, doc: str | None = None):
        self.suffix, self.__doc__ = suffix, doc

    def __get__(self, keys: ModelKeys | None, owner: type) -> str:
        if keys is None:
            return self  # type: ignore[return-value]  # the class attribute itself (help, docs)
        return keys.model + self.suffix


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
    correct = _Key(_CORRECT)
    total = _Key(_TOTAL)
    # a round's record
    acc_mean_over_clients = _Key(_MEAN_OVER_CLIENTS, "The unweighted mean of the clients' accuracies.")
    acc_sample_weighted = _Key(".acc_sample_weighted", "Sum correct / sum total over the clients.")
    acc_std_over_clients = _Key(".acc_std_over_clients", "The population std of the clients' accuracies.")
    acc_untrained_sample_weighted = _Key(".acc_untrained_sample_weighted",
                                         "Sum correct / sum total over the clients that have not trained yet.")
    acc_all_sample_weighted = _Key(".acc_all_sample_weighted", "Sum correct / sum total over every client's test samples.")
    # one client
    acc = _Key(_ACC)
    acc_ft = _Key(".acc_ft", "After one local fine-tune (the new-clients protocol).")
    # a comparison's row, the held-out clients' means
    acc_mean = _Key(".acc_mean")
    acc_std = _Key(".acc_std")
    acc_pooled = _Key(".acc_pooled", "Correct / test samples of all clients together.")
    acc_pooled_se = _Key(".acc_pooled_se", "The binomial standard error of :attr:`acc_pooled`.")
    acc_ft_mean = _Key(".acc_ft_mean")

    def acc_mean_last(self, n: int) -> str:
        """The mean of the last ``n`` evaluated rounds' :attr:`acc_mean_over_clients`."""
        return f"{self.model}.acc_mean_last{n}"


#: a round record's figures of one model, as :class:`ModelKeys` attribute names
ROUND_FIGURES = ("acc_mean_over_clients", "acc_sample_weighted", "acc_std_over_clients",
                 "acc_untrained_sample_weighted", "acc_all_sample_weighted")

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


def round_figure(key: str) -> tuple[str, str] | None:
    """``(model, figure)`` of a round record's accuracy key, ``figure`` one of :data:`ROUND_FIGURES`
    (``"proto@global.acc_sample_weighted"`` -> ``("proto@global", "acc_sample_weighted")``); None
    for any other key."""
    for figure in ROUND_FIGURES:
        suffix = vars(ModelKeys)[figure].suffix
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[:-len(suffix)], figure
    return None


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
           "ROUND_FIGURES", "TEST_SAMPLES", "client_accuracies", "counted_models", "evaluated_models", "global_count",
           "is_client_accuracy", "is_count", "model_counts", "round_figure", "totals"]
