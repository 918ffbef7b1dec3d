"""The server's screening of client uploads: what a received upload must be before it reaches
``server_aggregate``, and the server-side truth that replaces a client's claims.

Every upload of a round goes through :func:`screen_uploads` (in this process and on Flower), in
this order, and the first failed check rejects it:

1. *Size*: its bytes (the wire blob on Flower, checked before it is parsed; the tensors' raw bytes
   plus its names and metadata in this process, counted without serializing) at most
   :meth:`UploadPolicy.byte_limit`.
2. *Dtypes*: every tensor ``float32``, ``int32`` or ``int64`` (what the methods upload: weights,
   class ids, counts); ``float64``/``float16``/``bfloat16``/``bool``/complex are refused.
3. *Values*: floating values finite and ``|x| <= max_abs``; integer values in ``0..2**31-1``;
   metadata numbers finite.
4. *Shapes* (the method's ``upload_spec``) and the method's own ``check_upload``; BatchNorm running
   variances non-negative (:func:`check_bn_stats`).
5. *BatchNorm statistics against the round* (:func:`bn_outliers`): where at least 3 uploads hold a
   BN layer, running variances within a factor :data:`BN_VAR_RATIO` of the round's per-channel
   median and running means within :data:`BN_MEAN_STDS` standard deviations of it.

A rejected upload is logged (one ``warning:`` line naming the round, the client and the reason),
counted in the round's metrics (``rejected``, ``rejected_reasons``) and left out of the round; the
client's new state is discarded (as for a client that failed). A round with fewer valid uploads
than ``min_valid`` (of the clients that uploaded) is reported failed (``round_failed``) and changes
no server or client state.

Server-side truth: an accepted upload is counted (:meth:`Payload.count`: its bytes, then frozen)
and the server aggregates its own view of it, a new payload with the same tensors whose
``meta["n_samples"]`` is the client's registered training-sample count (its partition split,
:attr:`ClientInfo.n_samples`) and whose ``meta["client_id"]`` names the sender; the client's own
claim never weighs an average (a claim of 10**12 samples weighs as much as the honest count), and
the counted upload is never changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rafl.errors import UserInputError
from rafl.federation.payload import Payload, check_meta_value

#: the tensor dtypes an upload may hold
ALLOWED_DTYPES = (torch.float32, torch.int32, torch.int64)
#: integer tensors (class ids, sample counts, BatchNorm's num_batches_tracked) lie in 0..INT_MAX
INT_MAX = 2**31 - 1
#: added to the byte bound of a method with a fixed upload spec: names, shapes, metadata
HEADER_SLACK = 1 << 20
#: the byte bound of a method without a fixed upload spec (per-class vectors), at least
UNSPECIFIED_LIMIT = 16 << 20


@dataclass(frozen=True)
class UploadPolicy:
    """What the server accepts (the run config's ``engine`` keys of the same names).

    Attributes:
        max_upload_mb: the largest upload in MB (10**6 bytes), or None: twice the float32 size of
            the method's expected tensors plus 1 MiB, or (a method without a fixed spec) 16 MiB or
            twice the broadcast, whichever is larger.
        max_abs_value: the largest ``|x|`` of a floating value (> 0).
        min_valid_uploads: the fewest valid uploads a round needs (>= 1); below it the round fails.
    """

    max_upload_mb: float | None = None
    max_abs_value: float = 1e6
    min_valid_uploads: int = 1

    def __post_init__(self) -> None:
        if self.max_upload_mb is not None and not (math.isfinite(self.max_upload_mb) and self.max_upload_mb > 0):
            raise UserInputError(f"is {self.max_upload_mb}; allowed: a number > 0 or null", field="engine.max_upload_mb")
        if not (math.isfinite(self.max_abs_value) and self.max_abs_value > 0):
            raise UserInputError(f"is {self.max_abs_value}; allowed: a number > 0", field="engine.max_abs_value")
        if isinstance(self.min_valid_uploads, bool) or not isinstance(self.min_valid_uploads, int) \
                or self.min_valid_uploads < 1:
            raise UserInputError(f"is {self.min_valid_uploads!r}; allowed: an integer >= 1",
                                 field="engine.min_valid_uploads")

    def byte_limit(self, spec: Mapping[str, tuple[int, ...]] | None, broadcast_bytes: int = 0) -> int:
        """The largest upload in bytes for an expected ``name -> shape`` spec (or None)."""
        if self.max_upload_mb is not None:
            return int(self.max_upload_mb * 1e6)
        if spec is not None:
            return 2 * 4 * sum(math.prod(s) for s in spec.values()) + HEADER_SLACK
        return max(UNSPECIFIED_LIMIT, 2 * broadcast_bytes)


def raw_nbytes(upload: Payload) -> int:
    """An upper-bound-like size of ``upload`` without serializing it: the tensors' raw bytes, the
    names and the metadata's text (strings by length, numbers and list items at 24 bytes)."""
    size = sum(t.numel() * t.element_size() + len(k) for k, t in upload.tensors.items())
    for k, v in upload.meta.items():
        size += len(k) + (len(v) if isinstance(v, str) else 24 * len(v) if isinstance(v, (list, tuple)) else 24)
    return size


def raw_size(upload: Any) -> int:
    """:func:`raw_nbytes` of ``upload``, or 0 when it is not a readable :class:`Payload`."""
    try:
        return raw_nbytes(upload)
    except Exception:  # noqa: BLE001 - an object that is no payload: nothing countable was received
        return 0


def check_meta(upload: Payload) -> None:
    """Every metadata key a string and every value of a type the wire format carries (``int``,
    ``float``, ``str``, ``bool``, a flat list of numbers): what :class:`Payload` checks when it is
    built, again on what a client hands over (its ``meta`` may have changed since).

    Raises:
        UserInputError: naming the key (``field``) and the allowed types."""
    if not isinstance(upload, Payload):
        raise UserInputError(f"is a {type(upload).__name__}; allowed: a Payload")
    for key, value in upload.meta.items():
        if not isinstance(key, str):
            raise UserInputError(f"metadata key of type {type(key).__name__}; allowed: str")
        check_meta_value(key, value)


def check_values(upload: Payload, max_abs: float) -> None:
    """Dtype, finiteness and range of every tensor and metadata number (checks 2-3 above).

    Raises:
        UserInputError: naming the tensor or metadata key (``field``) and what is allowed."""
    allowed_names = ", ".join(str(d).replace("torch.", "") for d in ALLOWED_DTYPES)
    for name, t in upload.tensors.items():
        if t.dtype not in ALLOWED_DTYPES:
            raise UserInputError(f"is a {str(t.dtype).replace('torch.', '')} tensor; allowed: {allowed_names}",
                                 field=name)
        if t.numel() == 0:
            continue
        if t.is_floating_point():
            if not bool(torch.isfinite(t).all()):
                raise UserInputError("contains NaN or Inf values", field=name)
            top = float(t.abs().max())
            if top > max_abs:
                raise UserInputError(f"has a value of magnitude {top:.3g}; allowed: |x| <= {max_abs:g} "
                                     "(engine.max_abs_value)", field=name)
        else:
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi > INT_MAX:
                raise UserInputError(f"has integer values in {lo}..{hi}; allowed: 0..{INT_MAX}", field=name)
    for key, v in upload.meta.items():
        items = v if isinstance(v, (list, tuple)) else [v]
        for x in items:
            if isinstance(x, float) and not math.isfinite(x):
                raise UserInputError("is NaN or Inf", field=f"meta.{key}")
            if isinstance(x, int) and not isinstance(x, bool) and abs(x) > 2**63:
                raise UserInputError("is an integer of more than 63 bits", field=f"meta.{key}")


#: BatchNorm's running statistics, by the name PyTorch gives them (``<layer>.running_var``)
RUNNING_VAR, RUNNING_MEAN = "running_var", "running_mean"
#: the widest ratio of an upload's running variance to the round's median (of >= 3 uploads) of
#: the same channel, both ways (below it only for a channel whose median is at least
#: :data:`LIVE_VAR`): honest clients' statistics differ by their data, not by three orders of magnitude
BN_VAR_RATIO = 1e3
#: the farthest an upload's running mean may lie from the round's median, in the median's
#: standard deviations (at least ``sqrt(LIVE_VAR)``)
BN_MEAN_STDS = 100.0
#: a channel whose median running variance is below it (a dead channel) is not checked for a small variance
LIVE_VAR = 1e-2


def check_bn_stats(upload: Payload) -> None:
    """Every BatchNorm running variance (a tensor named ``*running_var``) non-negative: a variance
    is ``E[(x - mu)^2] >= 0``, and BN divides by ``sqrt(var + eps)``, so a negative one makes the
    model's outputs NaN (finite and in range, so :func:`check_values` passes it). A variance of 0
    (a channel that never fired) is honest and harmless (``eps > 0``).

    Raises:
        UserInputError: naming the tensor, the smallest value and what is allowed."""
    for name, t in upload.tensors.items():
        if name.endswith(RUNNING_VAR) and t.is_floating_point() and t.numel():
            low = float(t.min())
            if low < 0:
                raise UserInputError(f"is a BatchNorm running variance with a value of {low:.3g}; allowed: "
                                     "values >= 0", field=name)


def bn_outliers(uploads: Sequence[tuple[int, Payload]]) -> dict[int, str]:
    """The uploads whose BatchNorm running statistics lie outside the bound the round's uploads
    set together: for every ``*running_var`` tensor (and its ``*running_mean``) that at least 3 of
    ``uploads`` hold with one shape, the per-channel median ``m`` over them; an upload with a
    variance above ``BN_VAR_RATIO * max(m, LIVE_VAR)`` or below ``m / BN_VAR_RATIO`` (where ``m >=
    LIVE_VAR``), or a mean farther than ``BN_MEAN_STDS * sqrt(max(m, LIVE_VAR))`` from the median mean,
    is an outlier. While fewer than half the uploads are hostile, the median is an honest client's
    (Yin et al. 2018, Def. 1).

    Args:
        uploads: ``(client_id, payload)`` pairs, each already screened on its own.

    Returns:
        ``client_id -> reason`` (one line naming the tensor, the channel's value and the bound)."""
    out: dict[int, str] = {}
    keys: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for i, (_, up) in enumerate(uploads):
        for name, t in up.tensors.items():
            if name.endswith(RUNNING_VAR) and t.is_floating_point() and t.dim() == 1:
                keys.setdefault((name, tuple(t.shape)), []).append(i)
    for (name, _), holders in sorted(keys.items()):
        if len(holders) < 3:
            continue
        var = torch.stack([uploads[i][1].tensors[name].to(torch.float64) for i in holders])  # (m, C)
        med = var.median(dim=0).values
        floor = med.clamp(min=LIVE_VAR)
        mean_name = name[:-len(RUNNING_VAR)] + RUNNING_MEAN
        means = None
        if all(mean_name in uploads[i][1].tensors and uploads[i][1].tensors[mean_name].shape == var.shape[1:]
               for i in holders):
            means = torch.stack([uploads[i][1].tensors[mean_name].to(torch.float64) for i in holders])
        for row, i in enumerate(holders):
            cid = uploads[i][0]
            if cid in out:
                continue
            high = var[row] / floor
            low = torch.where(med >= LIVE_VAR, med / var[row].clamp(min=1e-30), torch.zeros_like(med))
            if float(high.max()) > BN_VAR_RATIO or float(low.max()) > BN_VAR_RATIO:
                c = int((high if float(high.max()) > BN_VAR_RATIO else low).argmax())
                out[cid] = (f"{name}: is a BatchNorm running variance of {float(var[row, c]):.3g} in channel {c}, the "
                            f"round's median is {float(med[c]):.3g}; allowed: within a factor {BN_VAR_RATIO:g} of "
                            "it (engine screening of BatchNorm statistics)")
                continue
            if means is not None:
                dev = (means[row] - means.median(dim=0).values).abs() / floor.sqrt()
                if float(dev.max()) > BN_MEAN_STDS:
                    c = int(dev.argmax())
                    out[cid] = (f"{mean_name}: is a BatchNorm running mean of {float(means[row, c]):.3g} in channel "
                                f"{c}, {float(dev[c]):.3g} standard deviations from the round's median; allowed: "
                                f"at most {BN_MEAN_STDS:g} (engine screening of BatchNorm statistics)")
    return out


@dataclass
class Screened:
    """The outcome of one round's screening.

    Attributes:
        accepted: the server's view of the valid uploads, in job order (:meth:`Payload.with_meta`:
            ``meta["client_id"]`` and the registered ``n_samples`` set), what ``server_aggregate`` takes.
        accepted_ids: their client ids, in job order.
        rejected: ``client_id -> reason`` (one line each).
        bytes_up: serialized bytes of the accepted uploads (:meth:`Payload.nbytes`).
        bytes_rejected: bytes of the rejected ones (wire bytes, or :func:`raw_nbytes`).
        claims_overridden: clients whose own ``n_samples`` differed from the registered count.
        client_errors: clients whose step raised (a :class:`ClientError`; their reason is in ``rejected``).
    """

    accepted: list[Payload] = field(default_factory=list)
    accepted_ids: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_rejected: int = 0
    claims_overridden: list[int] = field(default_factory=list)
    client_errors: list[int] = field(default_factory=list)


class RejectedUpload:
    """What a client runner returns in place of an upload it refused before parsing (e.g. a Flower
    reply whose blob is over the byte limit): the reason and the bytes received."""

    def __init__(self, reason: str, nbytes: int):
        self.reason, self.nbytes = reason, nbytes


class ClientError(RejectedUpload):
    """What a client runner returns in place of the upload of a client whose step raised a
    :class:`UserInputError` (diverged local training, a stored state that does not fit its model,
    a node that refused the message): that client's failure, left out of the round with its
    reason (``rejected_reasons``), never the run's error while at least ``engine.min_valid_uploads``
    valid uploads remain (:meth:`rafl.federation.engine.Engine._round`). Plain strings, so it crosses a worker's pipe.

    Args:
        message: the error's message.
        field: the field it names, or None.
        source: the error's own source (e.g. ``client 3 (model m)``), or None.
    """

    def __init__(self, message: str, field: str | None = None, source: str | None = None):
        super().__init__(f"{field}: {message}" if field else message, 0)
        self.message, self.field, self.source = message, field, source

    @classmethod
    def of(cls, err: UserInputError) -> ClientError:
        """The :class:`ClientError` of a raised ``err``."""
        return cls(err.message, err.field, err.source)

    def error(self) -> UserInputError:
        """The error as the client step raised it (what stops a run with too few clients left)."""
        return UserInputError(self.message, source=self.source, field=self.field)


def screen_uploads(results: Sequence[tuple[int, Payload | RejectedUpload]], algorithm: Any, server_state: Any,
                   clients: Sequence[Any], n_classes: int, policy: UploadPolicy, *,
                   limits: Mapping[int, int], sender: Callable[[int], str], nonfinite_hint: str = "") -> Screened:
    """Screen one round's uploads (the module docstring's checks 1-4) and set the server-side truth.

    Args:
        results: ``(client_id, upload)`` in job order, as a client runner returns them (a
            :class:`RejectedUpload` or :class:`ClientError` in place of an upload: recorded as rejected).
        algorithm: the method (its ``upload_spec`` and ``check_upload``).
        server_state: the server state the uploads answer.
        clients: every client's :class:`ClientInfo`, by id (``n_samples`` registered).
        n_classes: K.
        policy: the :class:`UploadPolicy`.
        limits: ``client_id -> byte limit`` (:meth:`UploadPolicy.byte_limit`).
        sender: ``client_id -> "client 3 (model ...)"`` for the reasons.
        nonfinite_hint: appended to a NaN/Inf reason (the likely cause).

    Returns:
        :class:`Screened`. Raises nothing for a bad upload: the reason is recorded instead.
    """
    out = Screened()
    sizes: dict[int, int] = {}  # the counted bytes of every accepted upload
    for cid, upload in results:
        info = clients[cid]
        if isinstance(upload, ClientError):
            out.rejected[cid] = f"{sender(cid)}: its client step failed: {upload.reason}"
            out.client_errors.append(cid)
            continue
        if isinstance(upload, RejectedUpload):
            out.rejected[cid] = f"payload from {sender(cid)}: {upload.reason}"
            out.bytes_rejected += upload.nbytes
            continue
        try:
            size = raw_nbytes(upload)
            if size > limits[cid]:
                raise UserInputError(f"holds {size} bytes; allowed: at most {limits[cid]} (engine.max_upload_mb)")
            check_meta(upload)
            check_values(upload, policy.max_abs_value)
            if algorithm.uploads_bn_statistics:
                check_bn_stats(upload)
            upload.validate(algorithm.upload_spec(server_state, info))
            algorithm.check_upload(upload, server_state, info, n_classes)
            sent = upload.count()  # what was sent; frozen from here on
        except UserInputError as err:
            hint = nonfinite_hint if "NaN or Inf" in err.message else ""
            out.rejected[cid] = UserInputError(err.message + hint, source=f"payload from {sender(cid)}",
                                               field=err.field).__str__()
            out.bytes_rejected += raw_size(upload)
            continue
        except Exception as err:  # noqa: BLE001 - anything else a client's object does is its upload's fault
            out.rejected[cid] = f"payload from {sender(cid)}: not a valid payload ({type(err).__name__}: " \
                                f"{str(err)[:120]})"
            out.bytes_rejected += raw_size(upload)
            continue
        sizes[cid] = sent.nbytes()
        out.bytes_up += sizes[cid]
        claim = sent.meta.get("n_samples")
        if "n_samples" in sent.meta and (type(claim) is not int or claim != info.n_samples):
            out.claims_overridden.append(cid)
        out.accepted.append(sent.with_meta(n_samples=int(info.n_samples), client_id=cid))
        out.accepted_ids.append(cid)
    screened_bn = bn_outliers(list(zip(out.accepted_ids, out.accepted))) if algorithm.uploads_bn_statistics else {}
    for cid, why in screened_bn.items():  # 5. BN statistics
        i = out.accepted_ids.index(cid)
        out.bytes_up -= sizes[cid]
        out.bytes_rejected += sizes[cid]
        del out.accepted[i], out.accepted_ids[i]
        if cid in out.claims_overridden:
            out.claims_overridden.remove(cid)
        out.rejected[cid] = f"payload from {sender(cid)}: {why}"
    return out


__all__ = ["ALLOWED_DTYPES", "INT_MAX", "UploadPolicy", "raw_nbytes", "raw_size", "check_meta", "check_values", "Screened",
           "RejectedUpload", "ClientError", "screen_uploads", "check_bn_stats", "bn_outliers", "BN_VAR_RATIO", "BN_MEAN_STDS",
           "LIVE_VAR"]
