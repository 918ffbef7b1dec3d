"""Supernet training beyond one process: torchrun / ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

``torchrun --nproc_per_node=N -m rafl supernet train ...`` starts N ranks; each runs
:func:`rafl.supernet.train.train_supernet`, which asks :func:`init_distributed` for its context.
What makes N ranks equal to one process with the same global batch ``B``:

* every rank draws the same subnets at every step (same seeds, same draws: the sandwich rule's
  largest + smallest + random subnets are identical on all ranks);
* every rank draws the same epoch permutation and the same augmentation of the global batch,
  then keeps its shard, rows ``rank, rank + N, ...`` (``DistributedSampler``'s interleaving,
  applied per global batch so the ranks' shards add up to exactly the single-process batch);
* BatchNorm statistics are taken over the global batch (:func:`synced_batch_norm`, the
  computation of ``torch.nn.SyncBatchNorm``, which supports neither CPU tensors nor ofa's
  elastic BN that slices its parameters), and the classifier's dropout mask is the global
  batch's mask, row for row;
* each rank's loss is its share of the global mean (sum over its rows / ``B``) and the gradients
  are summed over ranks once per optimizer step (:func:`all_reduce_gradients`), after every
  sampled subnet's backward pass. That is the reduction ``DistributedDataParallel`` does under
  ``no_sync()`` + one synchronized backward; DDP's own reducer is not used because its bucket
  bookkeeping assumes one graph per step, while the sandwich rule runs up to three subnets that
  use different parameter subsets.

Only rank 0 writes files; ``--resume`` reads the same checkpoint on every rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rafl.errors import UserInputError


@dataclass(frozen=True)
class DistContext:
    """This process's place in a distributed run (``world_size`` 1 = a plain single process).

    Attributes:
        rank: global rank, 0..world_size-1 (rank 0 writes every file).
        world_size: number of ranks.
        local_rank: rank on this node (selects ``cuda:<local_rank>``).
        backend: ``"gloo"``, ``"nccl"``, or ``None`` for a single process.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        """Whether more than one rank takes part."""
        return self.world_size > 1

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes files (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.distributed:
            dist.barrier()

    def device(self, kind: str) -> torch.device:
        """The torch device of this rank for ``kind`` ``"cpu"``/``"cuda"``."""
        return torch.device(f"cuda:{self.local_rank}") if kind == "cuda" else torch.device("cpu")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserInputError(f"is {value!r}, allowed: an integer (set by torchrun)", field=f"${name}") from None


def init_distributed(device: str, batch_size: int) -> DistContext:
    """The distributed context from torchrun's environment (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``); a single process without them.

    Initializes the default process group (``gloo`` for ``device == "cpu"``, ``nccl`` for CUDA)
    once, and pins CUDA ranks to ``cuda:LOCAL_RANK``.

    Raises:
        UserInputError: a world size that does not divide ``batch_size`` (the global batch, split
            evenly over ranks), or CUDA ranks without enough GPUs.
    """
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return DistContext()
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if batch_size % world:
        raise UserInputError(f"is {batch_size}, which {world} ranks cannot split evenly; allowed: a multiple "
                             f"of the world size {world} (batch_size is the global batch)", field="batch_size")
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        if torch.cuda.device_count() <= local_rank:
            raise UserInputError(f"rank {rank} needs cuda:{local_rank}, this node has {torch.cuda.device_count()} "
                                 "GPU(s); allowed: --nproc_per_node <= the GPUs per node", field="device")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, backend=backend)


def shard(batch: Tensor, ctx: DistContext) -> Tensor:
    """This rank's rows of a global batch: ``batch[rank::world_size]`` (all rows for one process)."""
    return batch[ctx.rank::ctx.world_size] if ctx.distributed else batch


def all_reduce_gradients(params: list[torch.nn.Parameter], extra: Tensor | None = None) -> Tensor | None:
    """Sum the gradients of ``params`` (and the 1-D tensor ``extra``, e.g. loss values) over all
    ranks, in place, with one flat all-reduce. Parameters without a gradient on this rank are
    skipped: every rank trains the same subnets, so the same ones lack it everywhere.

    Returns:
        the summed ``extra`` (None if not given).
    """
    grads = [p.grad for p in params if p.grad is not None]
    parts = [g.reshape(-1) for g in grads] + ([extra.reshape(-1)] if extra is not None else [])
    if not parts:
        return extra
    flat = torch.cat(parts)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
    return flat[offset:] if extra is not None else None


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """The sums over ranks of a few Python numbers (float64)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.cpu()]


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks whose backward sums the incoming gradients over ranks too (the adjoint of a
    sum all-reduce, as ``SyncBatchNorm``'s backward reduces its statistics' gradients)."""

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # noqa: ARG004 - autograd signature
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: ARG004
        out = grad.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out


def _global_batch_norm(orig, input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                       weight: Tensor | None = None, bias: Tensor | None = None, training: bool = False,
                       momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``F.batch_norm`` with the batch statistics of all ranks' inputs together.

    Mean and biased variance over ``(N, H, W)`` of the global batch, each from one autograd-aware
    sum all-reduce (:class:`_AllReduceSum`: its backward sums the gradients over ranks, as
    ``SyncBatchNorm``'s backward does); the running statistics move by
    ``momentum`` toward the global mean and the unbiased global variance. ``input``: ``(N, C, ...)``.
    """
    ar = _AllReduceSum.apply
    if not training:
        return orig(input, running_mean, running_var, weight, bias, training, momentum, eps)
    c = input.shape[1]
    dims = [0, *range(2, input.dim())]
    shape = [1, c] + [1] * (input.dim() - 2)
    local_n = input.numel() // c
    counted = ar(torch.cat([input.sum(dims), input.new_tensor([float(local_n)])]))
    n = counted[-1].detach()
    mean = counted[:c] / n
    centred = input - mean.view(shape)
    var = ar((centred * centred).sum(dims)) / n
    if running_mean is not None and running_var is not None and momentum:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.detach() * (n / (n - 1).clamp_min(1)), alpha=momentum)
    out = centred * torch.rsqrt(var.view(shape) + eps)
    if weight is not None:
        out = out * weight.view(shape)
    if bias is not None:
        out = out + bias.view(shape)
    return out


def _global_dropout(orig, ctx: DistContext, n_global: int, input: Tensor, p: float = 0.5, training: bool = True,
                    inplace: bool = False) -> Tensor:
    """``F.dropout`` whose mask is this rank's rows of the mask one process would draw for the
    global batch: every rank draws the ``(n_global, ...)`` noise from the same generator state
    (``bernoulli_(1 - p)``, then ``/ (1 - p)``, as PyTorch's CPU kernel does) and keeps rows
    ``rank::world_size``. ``input``: ``(n_local, ...)``."""
    if not training or p == 0 or input.numel() == 0:
        return orig(input, p, training, inplace)
    noise = torch.empty((n_global, *input.shape[1:]), dtype=input.dtype, device=input.device)
    noise.bernoulli_(1 - p).div_(1 - p)
    mask = noise[ctx.rank::ctx.world_size]
    return input.mul_(mask) if inplace else input * mask


@contextlib.contextmanager
def synced_batch_norm(ctx: DistContext, n_global: int) -> Iterator[None]:
    """Within the block, layers that see the whole batch behave as in one process with the
    global batch of ``n_global`` samples: every BatchNorm in training mode (``nn.BatchNorm2d``
    and ofa's ``DynamicBatchNorm2d`` both call ``torch.nn.functional.batch_norm``) normalizes
    with the global batch's statistics (:func:`_global_batch_norm`), and dropout draws the
    global batch's mask (:func:`_global_dropout`). A no-op for a single process. Every rank must
    run the same forward passes inside the block (collectives)."""
    if not ctx.distributed:
        yield
        return
    orig_bn, orig_dropout = F.batch_norm, F.dropout

    def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
        return _global_batch_norm(orig_bn, input, running_mean, running_var, weight, bias, training, momentum, eps)

    def dropout(input, p=0.5, training=True, inplace=False):
        return _global_dropout(orig_dropout, ctx, n_global, input, p, training, inplace)

    F.batch_norm, F.dropout = batch_norm, dropout
    try:
        yield
    finally:
        F.batch_norm, F.dropout = orig_bn, orig_dropout


def shutdown(ctx: DistContext) -> None:
    """Destroy the process group this run initialized (no-op for a single process)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["DistContext", "init_distributed", "shard", "all_reduce_gradients", "all_reduce_sum",
           "synced_batch_norm", "shutdown"]
