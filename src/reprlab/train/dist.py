"""Distributed helpers for ``torchrun`` (data parallelism on CPU/gloo or GPU/nccl).

Contrastive losses need every rank's features, so features are gathered across ranks *with* gradient
(open_clip's ``gather_with_grad``): every rank computes the same global loss, the gather's backward sums
the gradient copies, and DDP's averaging of parameter gradients over ranks then yields the single-process
full-batch gradient (up to float summation order).

Gradients are averaged by PyTorch's :class:`~torch.nn.parallel.DistributedDataParallel`: parameters are
grouped in buckets (25 MiB by default) whose all-reduce starts during backward as soon as the bucket's
gradients are ready, so communication overlaps compute and a ViT-B/32 makes a handful of collectives a
step instead of one per tensor. Trainers here call the encoders several times per step (views,
re-encoded captions); DDP wants one forward per backward, so :class:`StepModule` makes the step itself the
forward (as open_clip's training makes ``CLIP.forward`` return every feature of the step): the trainer calls
``ddp(step_fn, *args)`` and ``step_fn`` uses the plain model inside.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``rank`` of ``world_size``, ``local_rank`` on its machine, its ``device``."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(backend: str | None = None, device: str | None = None) -> DistInfo:
    """Initialise the process group from torchrun's env vars (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    Without them (a plain ``python`` launch) this is a single-process no-op. The backend defaults to nccl
    when CUDA is available, else gloo.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    dev = torch.device(f"cuda:{local}" if use_cuda else (device or "cpu"))
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if use_cuda else "gloo"), rank=rank, world_size=world)
    return DistInfo(rank, world, local, dev)


def rank_seed(seed: int, rank: int) -> int:
    """Per-rank seed (nanoGPT/open_clip habit): ranks draw different noise but stay reproducible."""
    return seed + rank


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(), len(x)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # every rank's copy of the global loss sends gradient to this rank's rows: sum them, keep ours
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-size ``(batch, ...)`` tensors of all ranks in rank order, differentiably."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _GatherWithGrad.apply(x)


@torch.no_grad()
def all_gather_nograd(x: torch.Tensor) -> torch.Tensor:
    """Concatenate ``(batch_r, ...)`` tensors of all ranks (sizes may differ) in rank order, no gradient."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(x)], device=x.device))
    top = int(max(s.item() for s in sizes))
    padded = torch.zeros((top, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: len(x)] = x
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])


class StepModule(nn.Module):
    """The module DDP wraps: holds ``model`` (so DDP sees its parameters) and runs a whole training step's
    forward as its ``forward(fn, *args, **kwargs) = fn(*args, **kwargs)``.

    ``fn`` calls ``model`` (the unwrapped one) as often as it needs: DDP counts one forward, and its
    autograd hooks fire once per parameter in the single backward that follows, whatever the number of calls.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)


def wrap_ddp(
    model: nn.Module, find_unused_parameters: bool = False, **kwargs
) -> DistributedDataParallel | None:
    """``DistributedDataParallel(StepModule(model))`` when a process group with several ranks is up, else None.

    Args:
        model: the model, already on its device (DDP broadcasts rank 0's parameters and buffers).
        find_unused_parameters: set when some steps leave parameters without gradient (a frozen encoder in
            one phase): DDP then walks the step's autograd graph to mark them ready (a little slower).
        kwargs: more :class:`DistributedDataParallel` options (``bucket_cap_mb``, ``static_graph``, ...).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    # device_ids=None: inputs stay where the step put them (they are the trainer and its batch, not tensors)
    return DistributedDataParallel(
        StepModule(model), device_ids=None, find_unused_parameters=find_unused_parameters, **kwargs
    )


def average_gradients(module: nn.Module) -> None:
    """All-reduce-mean every parameter gradient, one blocking collective per tensor (missing gradients count
    as zero so ranks stay in step).

    Kept only as the baseline of ``benchmarks/bench_dist.py``; training uses :func:`wrap_ddp`.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= world


@torch.no_grad()
def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (identical initialisation)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src)


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` itself without a process group of several ranks.
    For results that are sampled, so that ranks which computed them apart could disagree."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def main_first(fn: Callable[[], T], is_main: bool) -> T:
    """Run ``fn`` on the main rank, then (after a barrier) on the others: for stages that write files the other
    ranks then read back (a resumable stage finds the main rank's result and skips its work)."""
    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    result = fn() if is_main or not group else None
    if group:
        dist.barrier()
        if not is_main:
            result = fn()
    return result  # type: ignore[return-value]


def shard(n_global: int, rank: int, world_size: int) -> slice:
    """Contiguous slice of a global batch of ``n_global`` rows that ``rank`` owns (must divide evenly)."""
    if n_global % world_size:
        raise ValueError(f"global batch {n_global} is not divisible by world size {world_size}")
    per = n_global // world_size
    return slice(rank * per, (rank + 1) * per)
