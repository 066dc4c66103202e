"""Gradient reduction across 2 gloo ranks: the old per-parameter ``average_gradients`` against PyTorch's DDP.

Both variants train the otcclip-mosaic-tiny model (the recipe's ``model`` and ``train`` settings, TinyCLIP) with the
same trainer on the same poisoned mosaics, 2 CPU processes (``torch.multiprocessing.spawn``, gloo, one torch
thread each), global batch 50 (25 rows a rank):

- ``per_param``: the step as before DDP: backward, then one blocking ``all_reduce`` per parameter tensor
  (:func:`reprlab.train.dist.average_gradients`), so no communication overlaps the backward;
- ``ddp``: the trainer's step, ``DistributedDataParallel`` (25 MiB buckets, each reduced asynchronously as
  soon as its gradients are ready during backward).

Per variant: the median wall time of a step over ``--steps`` timed steps (after ``--warmup`` untimed ones, rank
0's clock; the ranks step in lockstep), and the collectives per step, counted on rank 0: Python-level ones
(``torch.distributed.all_reduce`` / ``all_gather`` / ``broadcast`` ..., which include the gathered CLIP
features of both variants) plus DDP's bucket all-reduces, counted by a comm hook in a separate, untimed step
(the hook calls PyTorch's own ``allreduce_hook``). The variants alternate over ``--repeats`` rounds so that a
shared machine's load moves both alike; the ratio is per round, reported as median [min - max].

Also printed (``--vit``): how DDP buckets a ViT-B/32 CLIP's parameters (open_clip's ``ViT-B-32`` built without
weights when open_clip is installed, else a module of the same tensor shapes from PyTorch layers): tensors vs
buckets, i.e. the gradient all-reduces per step of each method.

Run: ``python benchmarks/bench_dist.py`` (about 1-3 minutes on 2 loaded CPU cores). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from reprlab.methods.otcclip.config import DataConfig
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.trainer import Trainer, _StepResult, lr_factor
from reprlab.recipes import get_recipe
from reprlab.train.dist import DistInfo, average_gradients

_COUNTED = ("all_reduce", "all_gather", "broadcast", "barrier", "all_gather_into_tensor", "reduce_scatter")


class PerParamTrainer(Trainer):
    """The trainer's step with the old reduction: no DDP, one blocking all-reduce per parameter tensor."""

    def step(self, idx, epoch, step, phase):
        tc = self.tcfg
        g = epoch * self.steps_per_epoch + step
        lr = tc.lr * lr_factor(g, tc.warmup_steps, tc.epochs * self.steps_per_epoch, tc.min_lr_ratio)
        for group in self.opt.param_groups:
            group["lr"] = lr * self.impl.lr_scale(phase)
        b = self.batch(idx, epoch, step, phase)
        out = self.impl.step(self, b)
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        average_gradients(self.model)
        if tc.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.opt.step()
        return _StepResult(float(out.loss.detach()), out.terms, out.assignment, b.loc)


def _count_python_collectives() -> Counter:
    """Wrap ``torch.distributed``'s collectives with counters (modules call them as ``dist.<name>``)."""
    counts: Counter = Counter()
    for name in _COUNTED:
        real = getattr(dist, name)

        def counted(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        setattr(dist, name, counted)
    return counts


def _worker(rank: int, world: int, init: str, args, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    counts = _count_python_collectives()
    cfg = get_recipe("otcclip-mosaic-tiny").build_config()
    bed = build_testbed(
        DataConfig(n_pairs=args.pairs, max_items=2, captions_per_target=10, backdoor_pairs=20, n_eval=10,
                   n_probe_train=10),
        seed=0,
    )  # fmt: skip
    tok = WordTokenizer.from_texts(bed.pairs.captions)
    info = DistInfo(rank, world, rank, torch.device("cpu"))
    trainers = {}
    for name, cls in (("per_param", PerParamTrainer), ("ddp", Trainer)):
        torch.manual_seed(0)
        model = TinyCLIP(cfg.model, len(tok))
        trainers[name] = cls(model, bed.pairs, tok, args.defense, cfg.train, cfg.defense, seed=0, dist=info)
        if name == "per_param":
            trainers[name].ddp = None
    n_tensors = sum(p.requires_grad for p in trainers["ddp"].model.parameters())
    # the epoch-0 (non-matching) batches, cycled: the same work for every timed step
    batches = list(trainers["ddp"].global_batches(0, trainers["ddp"].phase(0), {}))
    phase = trainers["ddp"].phase(0)
    times: dict[str, list[float]] = {k: [] for k in trainers}
    per_step: dict[str, float] = {}
    k = 0
    for r in range(args.repeats):
        for name, tr in trainers.items():
            for i in range(args.warmup + args.steps):
                idx = batches[k % len(batches)]
                k += 1
                if r == 0 and i == args.warmup:  # count one step's collectives (untimed)
                    before = sum(counts.values())
                    tr.step(idx, 0, i, phase)
                    per_step[name] = sum(counts.values()) - before
                    continue
                dist.barrier()
                t0 = time.perf_counter()
                tr.step(idx, 0, i, phase)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
    # DDP's own bucket all-reduces run in C++ (not through torch.distributed.*): count them with a comm hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buckets = []

    def hook(state, bucket):
        buckets.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp_tr = trainers["ddp"]
    ddp_tr.ddp.register_comm_hook(None, hook)
    ddp_tr.step(batches[0], 0, 0, phase)
    per_step["ddp"] += len(buckets)
    if rank == 0:
        res = {
            "tensors": n_tensors,
            "ddp_buckets": len(buckets),
            "collectives_per_step": per_step,
            "times": times,
            "steps": args.steps,
            "repeats": args.repeats,
        }
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _clip_b32_shaped() -> nn.Module:
    """A module with the parameter tensors of open_clip's ViT-B-32 CLIP (vision: 32x32 patches, width 768,
    12 layers; text: width 512, 12 layers, 49,408 tokens; 512-d projections), built from PyTorch layers: what
    DDP's bucketing sees when open_clip is not installed (same shapes, same count up to naming)."""

    def tower(width: int, layers: int) -> nn.Module:
        layer = nn.TransformerEncoderLayer(width, width // 64, 4 * width, batch_first=True)
        return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    m = nn.Module()
    m.conv1 = nn.Conv2d(3, 768, 32, 32, bias=False)
    m.class_embedding = nn.Parameter(torch.zeros(768))
    m.positional_embedding = nn.Parameter(torch.zeros(50, 768))
    m.ln_pre, m.visual, m.ln_post = nn.LayerNorm(768), tower(768, 12), nn.LayerNorm(768)
    m.proj = nn.Parameter(torch.zeros(768, 512))
    m.token_embedding = nn.Embedding(49408, 512)
    m.text_positional_embedding = nn.Parameter(torch.zeros(77, 512))
    m.transformer, m.ln_final = tower(512, 12), nn.LayerNorm(512)
    m.text_projection = nn.Parameter(torch.zeros(512, 512))
    m.logit_scale = nn.Parameter(torch.zeros(()))
    return m


def vit_b32_buckets(bucket_mb: float = 25.0) -> dict:
    """How DDP buckets a ViT-B/32 CLIP (open_clip's when installed, else :func:`_clip_b32_shaped`; no weights
    loaded): tensors, DDP buckets, MiB of float32."""
    try:
        import open_clip

        model, source = open_clip.create_model("ViT-B-32", pretrained=None), "open_clip ViT-B-32"
    except ImportError:
        model, source = _clip_b32_shaped(), "ViT-B/32-shaped CLIP from torch layers (open_clip not installed)"
    params = [p for p in model.parameters() if p.requires_grad]
    # DDP's own assignment: parameters in reverse order, a 1 MiB first bucket, then bucket_cap_mb
    idx, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(params)), [1024 * 1024, int(bucket_mb * 1024 * 1024)], [False] * len(params)
    )
    return {"vit_b32_source": source, "vit_b32_tensors": len(params), "vit_b32_ddp_buckets": len(idx),
            "vit_b32_mbytes": round(sum(p.numel() * p.element_size() for p in params) / 2**20, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=400, help="training pairs of the testbed")
    ap.add_argument("--defense", default="otcclip", help="defense whose step is timed (epoch 0: no matching)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, variants alternating within each")
    ap.add_argument("--vit", action="store_true", help="also count a ViT-B/32's tensors and DDP buckets")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        mp.spawn(_worker, args=(2, os.path.join(tmp, "init"), args, out), nprocs=2, join=True)
        with open(out) as f:
            res = json.load(f)
    t, n = res["times"], args.steps
    rounds = [
        statistics.median(t["per_param"][i * n : (i + 1) * n])
        / statistics.median(t["ddp"][i * n : (i + 1) * n])
        for i in range(args.repeats)
    ]
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    print(
        f"otcclip-mosaic-tiny ({args.defense}, epoch 0), 2 gloo ranks, global batch 50, {res['tensors']} tensors:"
    )
    print(f"{'variant':<10} {'step ms (median)':>18} {'collectives/step':>18}")
    for k in ("per_param", "ddp"):
        print(f"{k:<10} {med[k]:>18.1f} {res['collectives_per_step'][k]:>18d}")
    print(f"DDP buckets per step: {res['ddp_buckets']}")
    ratio = statistics.median(rounds)
    print(
        f"per_param / ddp step time: {ratio:.2f} [{min(rounds):.2f} - {max(rounds):.2f}] over {args.repeats} rounds"
    )
    summary = {
        "step_ms_per_param": round(med["per_param"], 2),
        "step_ms_ddp": round(med["ddp"], 2),
        "ratio_per_param_over_ddp": round(ratio, 3),
        "ratio_min": round(min(rounds), 3),
        "ratio_max": round(max(rounds), 3),
        "collectives_per_step_per_param": res["collectives_per_step"]["per_param"],
        "collectives_per_step_ddp": res["collectives_per_step"]["ddp"],
        "ddp_buckets": res["ddp_buckets"],
        "tensors": res["tensors"],
    }
    if args.vit:
        vit = vit_b32_buckets()
        print(f"{vit['vit_b32_source']}: {vit['vit_b32_tensors']} tensors ({vit['vit_b32_mbytes']} MiB of "
              f"float32): per-parameter averaging makes {vit['vit_b32_tensors']} all-reduces a step, DDP "
              f"{vit['vit_b32_ddp_buckets']} bucket all-reduces")  # fmt: skip
        summary.update(vit)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
