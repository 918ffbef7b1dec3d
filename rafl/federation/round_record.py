"""One round's record, typed: what the engine counted and measured in a round, and its row.

The engine (:class:`rafl.federation.engine.Engine`) fills one :class:`RoundRecord` per completed
round by its fields and hands the records to its observers
(:class:`rafl.federation.engine.RunObserver`). :meth:`RoundRecord.as_row` gives the record as the
flat JSON object the run files hold: one line of ``metrics.jsonl``, one row of ``metrics.csv``,
one entry of the checkpoint's history; :meth:`RoundRecord.from_row` reads such a row back (the
checkpoint's history on ``--resume``), and ``from_row(row).as_row() == row``, key order included.

A row's keys, in this order (the attribute of the same name holds each value):

- the counters of every round (:data:`COUNTERS`): ``round``, ``sampled``, ``failed``,
  ``participated``, ``bytes_up``, ``bytes_down``, ``cum_bytes_up``, ``cum_bytes_down``,
  ``cum_mb``, ``bytes_up_per_client``, ``rejected``;
- where the round had them: ``rejected_reasons`` with ``bytes_rejected``,
  ``n_samples_overridden``, ``round_failed``, ``lost``;
- in an evaluated round, its :class:`RoundEvaluation`: every model's accuracies
  (``m.acc_mean_over_clients``, ``m.acc_sample_weighted``, ``m.acc_std_over_clients``, models by
  name), the means of the evaluation's other keys (``k.mean``), then where clients that had not
  trained were evaluated together ``eval.trained_clients``, ``eval.untrained_clients`` and every
  model's ``m.acc_untrained_sample_weighted``, ``m.acc_all_sample_weighted``, then ``eval_lost``;
- with a runner that sends messages (Flower; :data:`WIRE`): ``wire_bytes_down``,
  ``wire_bytes_up``, ``wire_bytes_eval_down``, ``cum_wire_mb``;
- the round's seconds (:data:`TIMES`): ``time_s``, ``time_client_update_s``,
  ``time_aggregate_s``, ``time_evaluate_s``, ``time_engine_s``.

A model ``m`` is named by the prefix of the :class:`~rafl.federation.algorithms.base.Accuracy`
the method declares for it (``model``, ``proto``, ``knowledge``, ...), with ``@global`` when scored
on the held-out global test set; its keys are :class:`~rafl.federation.metric_keys.ModelKeys`'.
This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rafl.federation.metric_keys import DEPLOYED_MODEL, ModelKeys, round_figure

#: the counters that begin every row, in order (each the name of a :class:`RoundRecord` attribute)
COUNTERS = ("round", "sampled", "failed", "participated", "bytes_up", "bytes_down", "cum_bytes_up",
            "cum_bytes_down", "cum_mb", "bytes_up_per_client", "rejected")
#: the bytes a runner's messages carried (Flower), in order
WIRE = ("wire_bytes_down", "wire_bytes_up", "wire_bytes_eval_down", "cum_wire_mb")
#: the round's seconds by part, in order: the last keys of every row
TIMES = ("time_s", "time_client_update_s", "time_aggregate_s", "time_evaluate_s", "time_engine_s")
#: the row values :class:`RoundRecord` computes from its other fields (properties)
DERIVED = ("participated", "cum_mb", "bytes_up_per_client", "rejected", "time_engine_s")

#: an evaluated round's count of clients evaluated one by one (with :data:`UNTRAINED_CLIENTS`)
TRAINED_CLIENTS = "eval.trained_clients"
#: an evaluated round's count of clients that had not trained, evaluated together
UNTRAINED_CLIENTS = "eval.untrained_clients"
#: the clients a runner could not evaluate, with the reason
EVAL_LOST = "eval_lost"
#: the suffix of the mean over clients of an evaluation key that is no count (``model.loss.mean``)
MEAN_SUFFIX = ".mean"

#: the figures of a model scored on the clients evaluated one by one (they come together)
_TRAINED_FIGURES = ("acc_mean_over_clients", "acc_sample_weighted", "acc_std_over_clients")
#: the figures of the shared evaluation of clients that had not trained
_UNTRAINED_FIGURES = ("acc_untrained_sample_weighted", "acc_all_sample_weighted")


def _by_client(reasons: Mapping[int, str]) -> dict[str, str]:
    """``client id -> reason`` as a row holds it: ids as strings, in increasing id order."""
    return {str(cid): why for cid, why in sorted(reasons.items())}


def _from_by_client(reasons: Mapping[str, str]) -> dict[int, str]:
    """A row's ``client id -> reason`` (ids as strings) as a record holds it."""
    return {int(cid): str(why) for cid, why in reasons.items()}


@dataclass
class ModelAccuracy:
    """One model's accuracies in an evaluated round, each a fraction in [0, 1] (None: not measured
    in that round). The attribute names are :class:`~rafl.federation.metric_keys.ModelKeys`' (the
    row key of ``acc_sample_weighted`` of model ``proto`` is ``proto.acc_sample_weighted``).

    Attributes:
        acc_mean_over_clients: the unweighted mean of the accuracies of the clients evaluated one
            by one (clients with an empty test split left out).
        acc_sample_weighted: their correct predictions / their test samples.
        acc_std_over_clients: the population standard deviation of their accuracies.
        acc_untrained_sample_weighted: correct / test samples over the clients that had not
            trained yet, evaluated together (one evaluation per architecture).
        acc_all_sample_weighted: correct / test samples over every evaluated client (both groups).
    """

    acc_mean_over_clients: float | None = None
    acc_sample_weighted: float | None = None
    acc_std_over_clients: float | None = None
    acc_untrained_sample_weighted: float | None = None
    acc_all_sample_weighted: float | None = None

    def _row(self, model: str, figures: tuple[str, ...]) -> dict[str, float]:
        keys = ModelKeys(model)
        return {getattr(keys, f): v for f in figures if (v := getattr(self, f)) is not None}


@dataclass
class RoundEvaluation:
    """What an evaluated round measured (:meth:`rafl.federation.engine.Engine._evaluate`).

    Attributes:
        accuracies: model name -> its :class:`ModelAccuracy` (``model``, ``proto``,
            ``model@global``, ...; a row lists the models by name).
        means: every key of the evaluation contract that is no count (e.g. ``model.loss``) ->
            its mean over the clients that reported it (row key ``model.loss.mean``).
        trained_clients: the clients evaluated one by one, where the clients that had not trained
            were evaluated together (else None, with :attr:`untrained_clients`).
        untrained_clients: the clients that had not trained, evaluated together.
        lost: client id -> why the runner could not evaluate it (a Flower node's error or
            timeout); those clients are in no accuracy.
    """

    accuracies: dict[str, ModelAccuracy] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)
    trained_clients: int | None = None
    untrained_clients: int | None = None
    lost: dict[int, str] = field(default_factory=dict)

    def mean_accuracy(self, model: str = DEPLOYED_MODEL) -> float | None:
        """``model``'s mean over clients (the deployed model's by default), None when not measured."""
        acc = self.accuracies.get(model)
        return None if acc is None else acc.acc_mean_over_clients

    def accuracy_row(self) -> dict[str, float]:
        """The accuracy keys of the row, in its order (``summary.json``'s ``final``)."""
        row: dict[str, float] = {}
        for figures in (_TRAINED_FIGURES, _UNTRAINED_FIGURES):
            for model in sorted(self.accuracies):
                row.update(self.accuracies[model]._row(model, figures))
        return row

    def as_row(self) -> dict[str, Any]:
        """The evaluation's keys of the round's row, in its order (module docstring)."""
        row: dict[str, Any] = {}
        for model in sorted(self.accuracies):
            row.update(self.accuracies[model]._row(model, _TRAINED_FIGURES))
        row.update({key + MEAN_SUFFIX: self.means[key] for key in sorted(self.means)})
        if self.untrained_clients is not None:
            row[TRAINED_CLIENTS], row[UNTRAINED_CLIENTS] = self.trained_clients, self.untrained_clients
        for model in sorted(self.accuracies):
            row.update(self.accuracies[model]._row(model, _UNTRAINED_FIGURES))
        if self.lost:
            row[EVAL_LOST] = _by_client(self.lost)
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RoundEvaluation:
        """The evaluation whose :meth:`as_row` is ``row`` (a round's evaluation keys only).

        Raises:
            ValueError: a key that is no evaluation key."""
        out = cls()
        for key, value in row.items():
            named = round_figure(key)
            if named is not None:
                model, figure = named
                setattr(out.accuracies.setdefault(model, ModelAccuracy()), figure, value)
            elif key == TRAINED_CLIENTS:
                out.trained_clients = value
            elif key == UNTRAINED_CLIENTS:
                out.untrained_clients = value
            elif key == EVAL_LOST:
                out.lost = _from_by_client(value)
            elif key.endswith(MEAN_SUFFIX):
                out.means[key[:-len(MEAN_SUFFIX)]] = value
            else:
                raise ValueError(f"{key!r} is no key of a round's record")
        return out


@dataclass
class RoundRecord:
    """One completed round (module docstring): its counters, what its evaluation measured and its
    seconds. Bytes are a payload's serialized bytes (:meth:`rafl.federation.payload.Payload.nbytes`,
    every client's copy of a broadcast counted); MB are 10**6 bytes.

    Attributes:
        round: the round's number, from 1.
        sampled: the clients sampled.
        failed: the sampled clients that did not upload: dropped out (``engine.dropout``), or lost
            by the runner (:attr:`lost`).
        bytes_up: bytes of the accepted uploads.
        bytes_down: bytes of every sampled client's download (a client that dropped out
            downloaded too).
        cum_bytes_up: :attr:`bytes_up` summed over the run's rounds so far, this one included.
        cum_bytes_down: the same of :attr:`bytes_down`.
        rejected_reasons: client id -> why the server refused its upload
            (:mod:`rafl.federation.screening`); those clients' new states were discarded.
        bytes_rejected: bytes of the refused uploads (in a row only beside :attr:`rejected_reasons`).
        n_samples_overridden: clients whose own ``n_samples`` claim the registered count replaced.
        round_failed: too few valid uploads, or a server step that diverged or gave an unusable
            model: the round changed no server or client state.
        lost: client id -> why the runner lost it in training (a Flower node's error or timeout).
        evaluation: what the round's evaluation measured; None in a round that was not evaluated.
        wire_bytes_down: bytes the runner's messages carried to the clients for training (a
            broadcast the clients of one node share travels once); None with a runner that sends
            no messages, like the other wire fields.
        wire_bytes_up: bytes its messages carried back.
        wire_bytes_eval_down: bytes its messages carried to the clients for evaluation.
        cum_wire_mb: MB of :attr:`wire_bytes_down` + :attr:`wire_bytes_up` over the run so far.
        time_s: seconds of the whole round (the engine's, the observers' and the checkpoint's
            time included, once the record is complete).
        time_client_update_s: seconds of the clients' computation.
        time_aggregate_s: seconds of the server step.
        time_evaluate_s: seconds of the evaluation.
    """

    round: int
    sampled: int
    failed: int
    bytes_up: int
    bytes_down: int
    cum_bytes_up: int
    cum_bytes_down: int
    rejected_reasons: dict[int, str] = field(default_factory=dict)
    bytes_rejected: int = 0
    n_samples_overridden: list[int] = field(default_factory=list)
    round_failed: bool = False
    lost: dict[int, str] = field(default_factory=dict)
    evaluation: RoundEvaluation | None = None
    wire_bytes_down: int | None = None
    wire_bytes_up: int | None = None
    wire_bytes_eval_down: int | None = None
    cum_wire_mb: float | None = None
    time_s: float = 0.0
    time_client_update_s: float = 0.0
    time_aggregate_s: float = 0.0
    time_evaluate_s: float = 0.0

    @property
    def participated(self) -> int:
        """The sampled clients that uploaded (accepted or not): :attr:`sampled` - :attr:`failed`."""
        return self.sampled - self.failed

    @property
    def rejected(self) -> int:
        """The uploads the server refused."""
        return len(self.rejected_reasons)

    @property
    def cum_mb(self) -> float:
        """MB sent up and down over the run so far (:attr:`cum_bytes_up` + :attr:`cum_bytes_down`)."""
        return (self.cum_bytes_up + self.cum_bytes_down) / 1e6

    @property
    def accepted(self) -> int:
        """The uploads the server accepted: :attr:`participated` - :attr:`rejected`."""
        return self.participated - self.rejected

    @property
    def bytes_up_per_client(self) -> float:
        """:attr:`bytes_up` (the accepted uploads' bytes) / :attr:`accepted` (at least 1); a refused
        upload's bytes are in ``bytes_rejected``, not here."""
        return self.bytes_up / max(1, self.accepted)

    @property
    def time_engine_s(self) -> float:
        """Seconds of the round that are neither the clients', the server step's nor the
        evaluation's (state I/O, payload counting and screening, sampling, records, checkpoint)."""
        return max(0.0, self.time_s - self.time_client_update_s - self.time_aggregate_s - self.time_evaluate_s)

    @property
    def accuracies(self) -> dict[str, ModelAccuracy]:
        """The evaluation's accuracies by model name ({} in a round that was not evaluated)."""
        return {} if self.evaluation is None else self.evaluation.accuracies

    def mean_accuracy(self, model: str = DEPLOYED_MODEL) -> float | None:
        """``model``'s mean over clients (the deployed model's by default); None in a round that
        did not measure it."""
        return None if self.evaluation is None else self.evaluation.mean_accuracy(model)

    def as_row(self) -> dict[str, Any]:
        """The record as one row of ``metrics.jsonl`` (module docstring: its keys and their order)."""
        row: dict[str, Any] = {key: getattr(self, key) for key in COUNTERS}
        if self.rejected_reasons:
            row["rejected_reasons"] = _by_client(self.rejected_reasons)
            row["bytes_rejected"] = self.bytes_rejected
        if self.n_samples_overridden:
            row["n_samples_overridden"] = list(self.n_samples_overridden)
        if self.round_failed:
            row["round_failed"] = True
        if self.lost:
            row["lost"] = _by_client(self.lost)
        if self.evaluation is not None:
            row.update(self.evaluation.as_row())
        if self.wire_bytes_down is not None:
            row.update({key: getattr(self, key) for key in WIRE})
        row.update({key: getattr(self, key) for key in TIMES})
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RoundRecord:
        """The record whose :meth:`as_row` is ``row`` (a row the engine wrote: a line of
        ``metrics.jsonl``, an entry of the checkpoint's history).

        Raises:
            ValueError: a missing counter, a key that is no key of a round's record, or a
                derived value (:data:`DERIVED`) that disagrees with the others."""
        rest = dict(row)
        kwargs: dict[str, Any] = {}
        own = [f.name for f in fields(cls) if f.name != "evaluation"]
        for name in own:
            if name in rest:
                kwargs[name] = rest.pop(name)
        for name in ("rejected_reasons", "lost"):
            if name in kwargs:
                kwargs[name] = _from_by_client(kwargs[name])
        derived = {name: rest.pop(name) for name in DERIVED if name in rest}
        missing = [name for name in COUNTERS + TIMES if name not in kwargs and name not in derived]
        if missing:
            raise ValueError(f"a round's row without {', '.join(missing)}")
        record = cls(**kwargs, evaluation=RoundEvaluation.from_row(rest) if rest else None)
        for name, value in derived.items():
            if name == "bytes_up_per_client" and value == record.bytes_up / max(1, record.participated):
                continue  # a row written while this divided by every upload, refused ones included
            if getattr(record, name) != value:
                raise ValueError(f"{name} is {value!r} in the row, but {getattr(record, name)!r} from its other values")
        return record


__all__ = ["COUNTERS", "DERIVED", "EVAL_LOST", "MEAN_SUFFIX", "ModelAccuracy", "RoundEvaluation", "RoundRecord",
           "TIMES", "TRAINED_CLIENTS", "UNTRAINED_CLIENTS", "WIRE"]
