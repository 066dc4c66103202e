"""Training from scratch with the loss on answer tokens only; dynamics logged along the way.

[ours] AdamW (lr 1e-3, betas (0.9, 0.99), little weight decay, no dropout: both suppress memorisation),
linear warm-up then cosine decay (``reprlab.train.schedule.warmup_cosine_factor``, applied per step so a
resumed run needs no scheduler state), batches from a per-epoch permutation seeded by ``(seed, epoch)`` so
a resumed run sees exactly the batches an uninterrupted one would. Every ``eval_every`` steps the
dynamics metrics (clean test EM, noisy memorised / true-answer rates) go to ``metrics.jsonl``; weights are
checkpointed every ``ckpt_every`` steps (tag ``train``, the last 2 kept for resume) and at the dynamics
snapshots (tag ``snapshots``, all kept) for analyses over training.

Under ``torchrun`` (``dist`` with several ranks) each rank takes a contiguous share of every global batch
and PyTorch's DDP averages the gradients (bucketed, overlapped with backward). The loss is the mean over the
*global* batch's answer tokens: each rank divides its token sum by the all-reduced token count, so the
gradient equals one process's on the whole batch up to float summation order (tested).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import Tensor, nn

from reprlab.methods.reason_to_rote.dataset import Batch
from reprlab.methods.reason_to_rote.evaluate import answer_matches, evaluate
from reprlab.models.gpt import GPT
from reprlab.models.hf_lm import HFCausalLM
from reprlab.train.dist import DistInfo, init_distributed, shard, wrap_ddp
from reprlab.train.schedule import warmup_cosine_factor


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (all [ours]; the paper's are unknown)."""

    steps: int = field(default=3000, metadata={"help": "maximum optimizer steps"})
    batch_size: int = field(default=256, metadata={"help": "items per step"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    beta1: float = field(default=0.9, metadata={"help": "AdamW beta1", "ge": 0, "lt": 1})
    beta2: float = field(default=0.99, metadata={"help": "AdamW beta2", "ge": 0, "lt": 1})
    weight_decay: float = field(
        default=0.0, metadata={"help": "AdamW weight decay (suppresses memorisation)"}
    )
    warmup_steps: int = field(
        default=100, metadata={"help": "linear warm-up steps before the cosine", "ge": 0}
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "final lr / peak lr of the cosine"})
    grad_clip: float = field(default=1.0, metadata={"help": "max global grad norm; 0 disables"})
    fused_adamw: bool = field(
        default=True,
        metadata={"help": "PyTorch's fused AdamW kernel (same update, one kernel; 1.3 -> 0.24 ms a step on "
                          "the tiny CPU model) [ours]; false = the per-parameter loop"},
    )  # fmt: skip
    eval_every: int = field(default=100, metadata={"help": "steps between dynamics evaluations"})
    eval_clean_items: int = field(
        default=500, metadata={"help": "clean training items evaluated at each dynamics step", "ge": 1}
    )
    ckpt_every: int = field(default=500, metadata={"help": "steps between resume checkpoints"})
    snapshot_every: int = field(default=500, metadata={"help": "steps between kept snapshots; 0 disables"})
    stop_memorized: float = field(
        default=1.01, metadata={"help": "stop early once noisy memorisation reaches this (>1 never stops)"}
    )
    max_steps: int = field(
        default=0,
        metadata={"help": "end training here without changing the schedule's horizon `steps` (0 = steps); "
                          "e.g. a control stopped where the noisy run of the same seed stopped"},
    )  # fmt: skip
    stop_generalized: float = field(
        default=0.0,
        metadata={"help": "and only once clean validation EM (val split, else test) is at least this [ours]"},
    )


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train`: final step, wall time, and the last evaluation."""

    step: int
    seconds: float
    stopped_early: bool
    final: dict


def answer_loss(model: nn.Module, batch: Batch, n_tokens: Tensor | float | None = None) -> Tensor:
    """Mean cross-entropy over answer tokens (incl. EOS) only; prompt tokens carry no loss.

    Our :class:`GPT` computes logits only from the first answer position of the batch on (``start``): the
    same loss up to float rounding, without the last block's MLP and the unembedding on prompt positions.
    A wrapped HF model (:class:`HFCausalLM`) skips the unembedding there (HF's ``logits_to_keep``).

    Args:
        n_tokens: divide the summed cross-entropy by this instead of the batch's own answer-token count
            (a rank's share of a global batch divides by the global count).
    """
    mask = batch.answer_mask()[:, 1:]  # (batch, pos-1): which next-token predictions carry loss
    targets = batch.ids[:, 1:]
    start = 0
    if isinstance(model, (GPT, HFCausalLM)) and mask.any():
        start = int(mask.any(0).nonzero()[0])
        mask, targets = mask[:, start:], targets[:, start:]
        logits = model(batch.ids[:, :-1], start=start)  # (batch, pos-1-start, d_vocab)
    else:
        logits = model(batch.ids[:, :-1])  # (batch, pos-1, d_vocab) predicts ids[:, 1:]
    mask = mask.to(logits.device)
    if n_tokens is None:
        return F.cross_entropy(logits[mask], targets.to(logits.device)[mask])
    return F.cross_entropy(logits[mask], targets.to(logits.device)[mask], reduction="sum") / n_tokens


def _rank_loss(model: nn.Module, batch: Batch, n_global: Tensor, world: int) -> Tensor:
    """This rank's term of the global batch's mean answer loss, times ``world``: DDP averages the ranks'
    gradients, so their mean is the gradient of the global mean."""
    return answer_loss(model, batch, n_global) * world


def run_dist(run) -> DistInfo:
    """The process group for ``run``'s device: one rank on a plain launch, torchrun's ranks otherwise (gloo on
    CPU, nccl on CUDA). Stages other than training run on every rank (rank 0 alone writes the run folder)."""
    return init_distributed(device="cpu" if run.device.type == "cpu" else None)


def _batch_indices(n: int, batch_size: int, step: int, seed: int) -> Tensor:
    steps_per_epoch = max(1, n // batch_size)  # drop the ragged tail so every batch has the same size
    epoch, k = divmod(step, steps_per_epoch)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=gen)
    return perm[k * batch_size : (k + 1) * batch_size]


def train(model: nn.Module, train_set: Batch, test: Batch, cfg: TrainConfig, run, seed: int,
          eval_subset: int | None = None, val: Batch | None = None,
          eval_noisy: Batch | None = None, dist: DistInfo | None = None) -> TrainResult:  # fmt: skip
    """Train ``model`` on ``train_set`` (noisy labels included) and log dynamics to ``run``.

    Args:
        train_set: all training items (``ids`` carry the training labels).
        test: clean held-out items.
        run: a :class:`reprlab.runs.Run` (metrics, checkpoints, resume).
        eval_subset: clean training items evaluated at each dynamics step (all noisy items always are);
            None = ``cfg.eval_clean_items``.
        val: clean validation items for the stopping rule (logged as ``val_em``); without it the rule reads
            the test EM.
        eval_noisy: the noisy items to track instead of ``train_set``'s own (the 0%-noise control trains on
            true labels everywhere and tracks the noisy labels it never saw).
        dist: rank info under torchrun; each rank trains on its share of every global batch (``batch_size``
            must divide by the world size), evaluates on its own, and rank 0's stopping decision is broadcast.

    Stopping rule [ours]: stop at the first evaluation where noisy memorisation >= ``stop_memorized`` *and*
    clean validation EM >= ``stop_generalized``. Stopping on memorisation alone keeps runs that memorised
    every training item without ever generalising (measured: seed 0 of an earlier 2,000-item recipe, test EM 0.13).
    Without noisy items the memorisation condition never holds, so a 0%-noise run trains to ``steps``.
    """
    device = run.device
    info = dist or DistInfo()
    model.to(device)
    rows = shard(cfg.batch_size, info.rank, info.world_size)  # also checks the batch divides over ranks
    ddp = wrap_ddp(model) if info.enabled else None
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=cfg.fused_adamw or None)  # fmt: skip
    start, stopped = 0, False
    restored = run.load_checkpoint({"model": model}, {"opt": opt}, tag="train") if run.resume else None
    if restored is not None:
        start, stopped = restored[0], bool(restored[1].get("stopped", False))
        run.logger.info(
            "resuming training at step %d%s", start, " (already stopped early)" if stopped else ""
        )
    noisy = (
        eval_noisy if eval_noisy is not None else train_set.select(torch.nonzero(train_set.noisy).flatten())
    )
    clean_idx = torch.nonzero(~train_set.noisy).flatten()
    clean = train_set.select(clean_idx[torch.randperm(len(clean_idx), generator=torch.Generator().manual_seed(seed))
                                       [:eval_subset or cfg.eval_clean_items]])  # fmt: skip
    data = train_set.to(device)
    t0, last, done = time.perf_counter(), {}, start
    end = min(cfg.max_steps, cfg.steps) if cfg.max_steps > 0 else cfg.steps
    remaining = range(start, start if stopped else end)
    for step in run.progress(remaining, total=len(remaining), desc="train"):
        model.train()
        lr = cfg.lr * warmup_cosine_factor(step, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        batch = data.select(_batch_indices(len(data), cfg.batch_size, step, seed).to(device))
        if ddp is None:
            loss = answer_loss(model, batch)
        else:
            batch = batch.select(torch.arange(rows.start, rows.stop, device=device))
            n_global = batch.answer_mask()[:, 1:].sum().to(device)
            torch_dist.all_reduce(n_global)
            loss = ddp(_rank_loss, model, batch, n_global, info.world_size)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # under DDP: returns with the gradients averaged over ranks
        if cfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        done = step + 1
        if done % cfg.eval_every == 0 or done == end:
            m = (
                evaluate(model, test, clean, noisy, device)
                if len(noisy)
                else evaluate(model, test, clean, clean, device)
            )
            value = loss.detach()
            if ddp is not None:  # the global batch's mean: the ranks' terms (each scaled by world) averaged
                torch_dist.all_reduce(value)
                value = value / info.world_size
            last = {"loss": round(value.item(), 5), "lr": lr, **asdict(m)}
            val_em = m.clean_test_em
            if val is not None:
                val_em = answer_matches(model, val.ids.to(device), val).all(1).float().mean().item()
                last["val_em"] = val_em
            if not len(noisy):
                last["noisy_memorized"] = last["noisy_true_answer"] = float("nan")
            run.log(done, **last)
            if len(noisy) and m.noisy_memorized >= cfg.stop_memorized and val_em >= cfg.stop_generalized:
                stopped = True
            if ddp is not None:  # rank 0 decides: evaluation noise must not let ranks stop at other steps
                flag = torch.tensor([float(stopped)], device=device)
                torch_dist.broadcast(flag, 0)
                stopped = bool(flag.item())
        if cfg.snapshot_every and (done % cfg.snapshot_every == 0 or stopped or done == end):
            run.save_checkpoint(done, {"model": model}, tag="snapshots", keep_last=10_000)
        if done % cfg.ckpt_every == 0 or stopped or done == end:
            run.save_checkpoint(done, {"model": model}, {"opt": opt}, extra={"stopped": stopped}, tag="train")
        if stopped:
            break
    model.eval()
    return TrainResult(step=done, seconds=time.perf_counter() - t0, stopped_early=stopped, final=last)
