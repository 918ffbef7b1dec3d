"""Server-side aggregation helpers shared by the methods.

* :func:`weighted_average` -- sample-weighted averaging of state dicts (FedAvg, McMahan et al.
  2017, Alg. 1; RaFL Eq. 7 for the knowledge networks);
* :func:`payload_weights` -- the weights ``n_l / N_S`` from uploads' ``n_samples`` (the engine
  replaces every upload's ``n_samples`` by the client's registered training-sample count before the
  server step, so a client's own claim never weighs: :mod:`rafl.federation.screening`);
* :func:`robust_average` / :func:`server_average` -- the run's aggregation rule
  (``engine.aggregation``): the weighted mean, or a Byzantine-robust rule: coordinate-wise median
  and coordinate-wise trimmed mean (Yin et al., "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, Defs. 1-2), or norm-bounded updates (Sun et al., "Can You
  Really Backdoor Federated Learning?", 2019, Sec. 4: every update ``theta_l - theta`` clipped to
  an L2 norm ``M`` before the weighted mean).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rafl.errors import UserInputError
from rafl.federation.payload import Payload

#: the largest ``n_samples`` a weight may come from (2**53: every count up to it is exact as a float);
#: a larger value is refused, never rounded or overflowed
MAX_SAMPLES = 2**53


def payload_weights(uploads: Sequence[Payload]) -> list[float]:
    """``n_l / N_S`` for every upload, ``N_S = sum_l n_l`` over the uploads (RaFL Eq. 7).

    ``n_l`` is ``meta["n_samples"]``; in a run the engine has set it to the client's registered
    training-sample count (the partition's), whatever the client sent.

    Raises:
        UserInputError: an upload whose ``meta["n_samples"]`` is not a whole number in
            ``1..MAX_SAMPLES`` (a boolean, a fraction, NaN, 10**400 are refused).
    """
    counts = []
    for p in uploads:
        n = p.meta.get("n_samples")
        whole = isinstance(n, int) and not isinstance(n, bool)
        if isinstance(n, float) and math.isfinite(n) and n.is_integer():
            n, whole = int(n), True
        if not whole or not 1 <= n <= MAX_SAMPLES:
            shown_n = n if whole and abs(n) < 10**30 else type(n).__name__ if not whole else "a huge integer"
            raise UserInputError(f"needs n_samples a whole number in 1..2**53, got {shown_n!r}",
                                 source=f"payload from client {p.meta.get('client_id', '?')}")
        counts.append(int(n))
    total = sum(counts)
    return [c / total for c in counts]


def weighted_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """``sum_l w_l * theta_l`` key by key (RaFL Eq. 7: ``theta_k = sum_l (n_l / N_S) theta_k^l``).

    Floating tensors are averaged in float64 and cast back to their dtype; integer tensors (e.g.
    BatchNorm's ``num_batches_tracked``) take the weighted average rounded to the nearest integer.

    Args:
        states: >= 1 mappings with identical keys and shapes.
        weights: one weight per state; normalized to sum to 1 here.

    Returns:
        a new state dict (CPU tensors).

    Raises:
        ValueError: no states, mismatched lengths, keys or shapes, or non-positive total weight.
    """
    if not states or len(states) != len(weights):
        raise ValueError(f"need >= 1 state and one weight per state, got {len(states)} and {len(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to > 0")
    w = [float(x) / total for x in weights]
    keys = list(states[0].keys())
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        ref = states[0][key]
        acc = torch.zeros(ref.shape, dtype=torch.float64)
        for s, wi in zip(states, w):
            if key not in s:
                raise ValueError(f"state is missing {key!r}")
            t = s[key]
            if t.shape != ref.shape:
                raise ValueError(f"{key!r}: shape {tuple(t.shape)} != {tuple(ref.shape)}")
            acc += wi * t.detach().to("cpu", torch.float64)
        out[key] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
    return out


#: the values of ``engine.aggregation``
AGGREGATIONS = ("mean", "median", "trimmed_mean", "norm_clip")


@dataclass(frozen=True)
class AggregationRule:
    """How the weight-averaging methods merge the uploads (``engine.aggregation`` and its options).

    Attributes:
        name: ``mean`` (sample-weighted mean), ``median`` (coordinate-wise median, Yin et al.
            2018 Def. 1), ``trimmed_mean`` (coordinate-wise ``beta``-trimmed mean, Def. 2) or
            ``norm_clip`` (updates clipped to an L2 norm, Sun et al. 2019).
        trim_fraction: ``beta`` in ``[0, 0.5)``: ``floor(beta * m)`` largest and smallest values of
            every coordinate are dropped over ``m`` uploads.
        clip_norm: ``M`` (> 0) for ``norm_clip``, or None: the lower median of the round's weighted update norms.
    """

    name: str = "mean"
    trim_fraction: float = 0.1
    clip_norm: float | None = None

    def __post_init__(self) -> None:
        if self.name not in AGGREGATIONS:
            raise UserInputError(f"is {self.name!r}; allowed: {', '.join(AGGREGATIONS)}", field="engine.aggregation")
        if not 0 <= self.trim_fraction < 0.5:
            raise UserInputError(f"is {self.trim_fraction}; allowed: a fraction in [0, 0.5)",
                                 field="engine.trim_fraction")
        if self.clip_norm is not None and not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise UserInputError(f"is {self.clip_norm}; allowed: a number > 0 or null (the median update norm)",
                                 field="engine.clip_norm")


#: the fewest uploads whose lower-median update norm bounds a round by itself; below it a round is
#: clipped against the bound carried from earlier rounds (:class:`ClipBounds`)
OWN_BOUND_UPLOADS = 3
#: the recorded rounds a carried bound is the median of (the most recent ones)
CARRIED_ROUNDS = 20


def lower_median(values: Sequence[float]) -> float:
    """The lower median of ``values`` (for an even count the smaller middle value); 0.0 when empty."""
    return sorted(values)[(len(values) - 1) // 2] if values else 0.0


@dataclass
class ClipBounds:
    """A ``norm_clip`` bound the round's own uploads cannot set: the update norms of earlier rounds.

    A round with at least :data:`OWN_BOUND_UPLOADS` uploads records the lower median of its update
    norms ``||Delta_l||_2`` (at most the largest honest norm while fewer than half the uploads are
    hostile). A round with fewer uploads is one whose lower median may be the attacker's own norm,
    so every update is also clipped to the *carried* bound ``M``: the median of the last
    :data:`CARRIED_ROUNDS` recorded values; before any round recorded one, ``M`` is the L2 norm of
    the model the clients started from (no update larger than the model it updates). Such a round
    records the lower median of its clipped norms, so a lone attacker never raises ``M``. Kept in
    the engine's checkpoint (:meth:`to_json`), so a resumed run clips as an uninterrupted one.

    Attributes:
        norms: ``what -> recorded norms`` in round order (``what`` names the tensors clipped, e.g.
            ``"weights"``; methods that clip several kinds keep one history each).
    """

    norms: dict[str, list[float]] = field(default_factory=dict)

    def carried(self, what: str) -> float | None:
        """The carried bound ``M`` of ``what`` (None before any recorded round)."""
        recent = self.norms.get(what, [])[-CARRIED_ROUNDS:]
        return float(sorted(recent)[len(recent) // 2]) if recent else None

    def scales(self, norms: Sequence[float], scales: Sequence[float], what: str, model_norm: float) -> list[float]:
        """``scales`` (the round's own clip factors of updates with L2 norms ``norms``), each also at
        most ``M / ||Delta_l||`` when the round has fewer than :data:`OWN_BOUND_UPLOADS` updates,
        and the round's norm recorded (see the class docstring).

        Args:
            norms: ``||Delta_l||_2`` of every update.
            scales: the factors the round's own rule gave.
            what: the history to use.
            model_norm: ``||theta||_2`` of the model the clients started from (the bound before any
                recorded round; 0: none, the round's own rule alone).

        Returns:
            one factor in ``[0, 1]`` per update."""
        out = list(scales)
        if len(norms) >= OWN_BOUND_UPLOADS:
            self.norms.setdefault(what, []).append(lower_median(norms))
            return out
        bound = self.carried(what)
        if bound is None and model_norm > 0:
            bound = model_norm
        if bound is None:
            return out
        out = [min(s, 1.0 if n <= bound or n == 0 else bound / n) for s, n in zip(out, norms)]
        self.norms.setdefault(what, []).append(lower_median([n * s for n, s in zip(norms, out)]))
        return out

    def to_json(self) -> dict[str, list[float]]:
        """The histories as plain JSON (the checkpoint's counters)."""
        return {k: list(v) for k, v in self.norms.items()}

    @classmethod
    def from_json(cls, obj: Any) -> ClipBounds:
        """What :meth:`to_json` wrote (an empty memory for None or anything else)."""
        if not isinstance(obj, dict):
            return cls()
        return cls({str(k): [float(x) for x in v] for k, v in obj.items() if isinstance(v, list)})


def _stacked(states: Sequence[Mapping[str, torch.Tensor]], key: str) -> torch.Tensor:
    ref = states[0][key]
    rows = []
    for s in states:
        if key not in s:
            raise ValueError(f"state is missing {key!r}")
        if s[key].shape != ref.shape:
            raise ValueError(f"{key!r}: shape {tuple(s[key].shape)} != {tuple(ref.shape)}")
        rows.append(s[key].detach().to("cpu", torch.float64))
    return torch.stack(rows)  # (m, *shape)


def _cast(acc: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)


def coordinatewise(rows: torch.Tensor, rule: AggregationRule) -> torch.Tensor:
    """The coordinate-wise ``median`` (Yin et al. 2018, Def. 1: the mean of the two middle values
    for even ``m``) or ``beta``-``trimmed_mean`` (Def. 2: the ``floor(beta m)`` largest and smallest
    values dropped) over dim 0 of ``rows`` ``(m, *shape)``; returns ``(*shape)``."""
    m = rows.shape[0]
    ordered = rows.sort(dim=0).values
    if rule.name == "median":
        return ordered[(m - 1) // 2] if m % 2 else (ordered[m // 2 - 1] + ordered[m // 2]) / 2
    b = int(math.floor(rule.trim_fraction * m))
    return ordered[b:m - b].mean(dim=0)


def robust_average(states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float],
                   rule: AggregationRule | None = None,
                   reference: Mapping[str, torch.Tensor] | None = None,
                   bounds: ClipBounds | None = None, what: str = "weights") -> dict[str, torch.Tensor]:
    """Merge ``m`` state dicts by ``rule`` (default: :func:`weighted_average`).

    * ``median``: per coordinate the median of the ``m`` values (the mean of the two middle ones
      for even ``m``); weights are not used (Yin et al. 2018, Def. 1).
    * ``trimmed_mean``: per coordinate, drop the ``b = floor(beta m)`` largest and smallest values
      and average the other ``m - 2b`` (Def. 2); weights are not used.
    * ``norm_clip``: ``theta = ref + sum_l w_l * Delta_l * s_l`` with ``Delta_l = theta_l - ref``
      over the floating tensors of a state (its global L2 norm) and ``s_l = min(1, M /
      ||Delta_l||_2)`` for ``M = rule.clip_norm`` (Sun et al. 2019, Sec. 4); with no ``clip_norm``,
      ``s_l = min(1, T / (w_l ||Delta_l||_2))`` for ``T`` the lower median of the round's terms
      ``w_l ||Delta_l||_2``, so no client's term outweighs the largest honest one while fewer than
      half are hostile; with fewer than 3 states every update is also clipped to the bound carried
      from earlier rounds (``bounds``, :class:`ClipBounds`), which the round's own uploads cannot
      set. Integer tensors take the weighted mean. ``reference`` is the model the clients started
      from (the previous global); None when the states already are updates (a zero reference).

    Args:
        states: >= 1 mappings with identical keys and shapes, e.g. ``(C_out, C_in, k, k)`` tensors.
        weights: one weight per state (normalized here); for ``mean`` and ``norm_clip``.
        rule: the :class:`AggregationRule`, or None (``mean``).
        reference: ``norm_clip`` only: ``key -> tensor`` the updates are measured from.
        bounds: ``norm_clip`` without ``clip_norm`` only: the run's :class:`ClipBounds` (updated
            here), or None (the round's own bound alone).
        what: which history of ``bounds`` to use.

    Returns:
        a new state dict (CPU tensors, the dtypes of ``states[0]``).

    Raises:
        ValueError: no states, mismatched lengths, keys or shapes, or non-positive total weight.
    """
    if rule is None or rule.name == "mean" or len(states) == 1 and rule.name != "norm_clip":
        return weighted_average(states, weights)
    if not states or len(states) != len(weights):
        raise ValueError(f"need >= 1 state and one weight per state, got {len(states)} and {len(weights)}")
    out: dict[str, torch.Tensor] = {}
    if rule.name in ("median", "trimmed_mean"):
        for key, ref in states[0].items():
            out[key] = _cast(coordinatewise(_stacked(states, key), rule), ref)
        return out
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to > 0")
    w = [float(x) / total for x in weights]
    floats = [k for k, v in states[0].items() if v.is_floating_point()]
    refs = {k: (reference[k].detach().to("cpu", torch.float64) if reference is not None
                else torch.zeros(states[0][k].shape, dtype=torch.float64)) for k in floats}
    norms = update_norms(states, refs)
    if rule.clip_norm is not None:
        scale = clip_scales(norms, rule.clip_norm)
    else:  # every client's term w_l * ||Delta_l|| at most the lower median term: no client outweighs an honest one
        terms = [wi * n for wi, n in zip(w, norms)]
        scale = clip_scales(terms)
        if bounds is not None:  # fewer than 3 uploads: their own median is no bound
            model_norm = math.sqrt(sum(float((r ** 2).sum()) for r in refs.values()))
            scale = bounds.scales(norms, scale, what, model_norm)
    for key, ref in states[0].items():
        rows = _stacked(states, key)
        if key in refs:
            acc = refs[key] + sum(wi * si * (row - refs[key]) for wi, si, row in zip(w, scale, rows))
        else:
            acc = sum(wi * row for wi, row in zip(w, rows))
        out[key] = _cast(acc, ref)
    return out


def update_norms(states: Sequence[Mapping[str, torch.Tensor]], references: Mapping[str, torch.Tensor] | Sequence[
        Mapping[str, torch.Tensor]]) -> list[float]:
    """``||theta_l - ref_l||_2`` of every state over the floating tensors its reference holds (the
    global L2 norm of the update; Sun et al. 2019, Sec. 4).

    Args:
        states: ``m`` mappings ``name -> tensor`` (any shapes).
        references: one mapping for all states, or one per state (e.g. FedDF's per-group globals);
            only its keys are measured.

    Returns:
        ``m`` norms (float64 arithmetic)."""
    per = references if isinstance(references, Sequence) else [references] * len(states)
    out = []
    for s, ref in zip(states, per):
        sq = sum(float(((s[k].detach().to("cpu", torch.float64) - ref[k].detach().to("cpu", torch.float64)) ** 2)
                       .sum()) for k in ref if s[k].is_floating_point())
        out.append(math.sqrt(sq))
    return out


def clip_scales(norms: Sequence[float], bound: float | None = None) -> list[float]:
    """The factor ``min(1, M / n_l)`` of every norm ``n_l``, ``M = bound`` or the lower median of
    ``norms`` (for an even count the smaller middle value, so of 2 clients neither moves the result
    further than the other; a minority of clients, however large, is bounded by an honest norm)."""
    if not norms:
        return []
    m = bound if bound is not None else sorted(norms)[(len(norms) - 1) // 2]
    return [1.0 if n <= m or n == 0 else m / n for n in norms]


def clipped_states(states: Sequence[Mapping[str, torch.Tensor]], references: Sequence[Mapping[str, torch.Tensor]],
                   rule: AggregationRule | None, bounds: ClipBounds | None = None,
                   what: str = "teachers") -> list[dict[str, torch.Tensor]]:
    """Every state with its update ``theta_l - ref_l`` clipped to the round's bound (``rule.clip_norm``
    or the lower median of the update norms; under ``norm_clip`` with fewer than 3 states also the
    bound carried in ``bounds``, :class:`ClipBounds`), floating tensors only: what a single client may
    contribute beyond an average (FedDF's teachers, Lin et al. 2020 Alg. 1, each clipped before it
    predicts). Under ``mean`` (or no rule) the states come back unchanged."""
    if rule is None or rule.name == "mean":
        return [dict(s) for s in states]
    norms = update_norms(states, references)
    scales = clip_scales(norms, rule.clip_norm)
    if bounds is not None and rule.clip_norm is None and rule.name == "norm_clip":
        model_norm = lower_median([math.sqrt(sum(float((r[k].detach().to(torch.float64) ** 2).sum())
                                                 for k in r if r[k].is_floating_point())) for r in references])
        scales = bounds.scales(norms, scales, what, model_norm)
    out = []
    for s, ref, sc in zip(states, references, scales):
        out.append({k: (ref[k].to(v.dtype) + sc * (v - ref[k].to(v.dtype))) if k in ref and v.is_floating_point()
                    and sc < 1 else v for k, v in s.items()})
    return out


def bound_vectors(per_client: Sequence[Mapping[int, torch.Tensor]], server: Any) -> list[dict[int, torch.Tensor]]:
    """Per-class vectors (prototypes, LARs, mean logits: ``{class id: (r,) float32}`` per client)
    with every vector's L2 norm clipped to the median norm of its class over the round's clients
    (the lower median; over all the round's vectors when fewer than 3 clients sent that class), the
    norm bound of Sun et al. 2019 (Sec. 4) applied to the vectors the prototype and header methods
    average or train on. Under ``mean`` (or no rule on ``server``) the vectors come back unchanged.

    Returns:
        one ``{class id: (r,) float32}`` per client, in order."""
    rule = getattr(server, "aggregation", None)
    if rule is None or rule.name == "mean":
        return [dict(p) for p in per_client]
    norms = {i: {c: float(v.detach().to(torch.float64).norm()) for c, v in p.items()} for i, p in enumerate(per_client)}
    everything = [n for d in norms.values() for n in d.values()]
    overall = sorted(everything)[(len(everything) - 1) // 2] if everything else 0.0
    by_class: dict[int, list[float]] = {}
    for d in norms.values():
        for c, n in d.items():
            by_class.setdefault(c, []).append(n)
    bound = {c: (rule.clip_norm if rule.clip_norm is not None else
                 sorted(ns)[(len(ns) - 1) // 2] if len(ns) >= 3 else overall) for c, ns in by_class.items()}
    return [{c: (v * (bound[c] / norms[i][c])).to(v.dtype) if norms[i][c] > bound[c] else v for c, v in p.items()}
            for i, p in enumerate(per_client)]


def server_average(states: Sequence[Mapping[str, torch.Tensor]], uploads: Sequence[Payload], server: Any,
                   reference: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """:func:`robust_average` of ``states`` with the weights :func:`payload_weights` of
    ``uploads`` and the run's rule (``server.aggregation``, an :class:`AggregationRule` on the
    :class:`~rafl.federation.algorithms.base.ServerContext`; the mean when it has none) and its
    carried clip bounds (``server.clip_bounds``, :class:`ClipBounds`, or none)."""
    rule = getattr(server, "aggregation", None)
    return robust_average(states, payload_weights(uploads), rule, reference, getattr(server, "clip_bounds", None))


__all__ = ["weighted_average", "payload_weights", "MAX_SAMPLES", "AGGREGATIONS", "AggregationRule", "robust_average",
           "ClipBounds", "lower_median", "OWN_BOUND_UPLOADS", "CARRIED_ROUNDS",
           "server_average", "coordinatewise", "update_norms", "clip_scales", "clipped_states", "bound_vectors"]
