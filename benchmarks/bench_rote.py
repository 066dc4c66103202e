"""Reason to Rote benchmark: training throughput of our hookable GPT vs HF GPT2LMHeadModel, and an
activation-patching sweep with our hooks vs TransformerLens on the same model.

Training. Both models get the same configuration and initial weights (``to_hf_gpt2``), the same batches and
the same optimizer (AdamW, fused as in the recipe's ``train.fused_adamw``; ``--optimizer loop`` for the
per-parameter loop); HF GPT-2 runs with its default attention implementation and dropout 0. Two of our steps
are timed:

* ``model``: the same full-sequence forward and answer-only loss as HF (the model alone);
* ``recipe``: ``train.answer_loss``, which asks our GPT for logits from the first answer position on
  (``GPT.forward(ids, start=...)``), as the rote recipes train.

Steps of the three are interleaved in rounds, and each step is timed by the CPU time of the timing thread
(``time.thread_time``, with one torch thread by default as the CPU recipes use) as well as wall time: on the
shared 2-core machine other jobs preempt us, which inflates wall time at random but not CPU time. Medians.

Patching. The corrupted run's ``blocks.{i}.hook_resid_pre`` is patched into the clean run at every
(layer, position); the metric per cell is the mean over items of the L1 change of the last position's
log-probabilities. TransformerLens (``pip install 'reprlab[lens]'``) gets *our* model converted by
``reprlab.interp.lens.to_hooked_transformer`` and the same grid, items and metric; the script prints the time
ratio and the max difference of the patched metrics.

Defaults are the rote-fda-tiny model and batch (2 layers, d_model 64, batch 64, 16 tokens); ``--layers 4
--d-model 128 --batch 256`` is tier M [ours].

Usage: python benchmarks/bench_rote.py [--rounds 8] [--steps 10] [--batch 64] [--layers 2] [--d-model 64]
       [--threads 1] [--optimizer fused|loop]
Last line printed: one JSON object with ``train_speedup_vs_hf`` (recipe step), ``train_speedup_vs_hf_model``
and, with TransformerLens installed, ``patching_speedup_vs_tl`` and ``patching_max_abs_diff_vs_tl``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from reprlab.hooks import patch, patch_positions, run_with_cache
from reprlab.methods.reason_to_rote.dataset import Batch
from reprlab.methods.reason_to_rote.train import answer_loss
from reprlab.models.gpt import GPT, GPTConfig, to_hf_gpt2

SEQ, PROMPT = 16, 10  # FDA: 10 prompt tokens + 5 answer digits + EOS


def _full_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])


def _fda_batch(ids: torch.Tensor) -> Batch:
    n = len(ids)
    return Batch(
        ids=ids, ids_true=ids, answer_start=torch.full((n,), PROMPT), answer_len=torch.full((n,), SEQ - PROMPT),
        noisy=torch.zeros(n, dtype=torch.bool),
    )  # fmt: skip


def make_step(model, kind: str, optimizer: str, mask: torch.Tensor):
    """A closure running one training step on a batch of ids; kind: hf | model | recipe."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=(optimizer == "fused") or None)
    model.train()

    def step(ids: torch.Tensor) -> None:
        if kind == "hf":
            loss = _full_loss(model(ids[:, :-1]).logits, ids, mask)
        elif kind == "model":
            loss = _full_loss(model(ids[:, :-1]), ids, mask)
        else:
            loss = answer_loss(model, _fda_batch(ids))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def time_training(steps: dict, batches: list[torch.Tensor], rounds: int, warmup: int = 3) -> dict:
    """Median (cpu_s, wall_s) per step of each closure; rounds interleave the closures against load drift."""
    for fn in steps.values():
        for ids in batches[:warmup]:
            fn(ids)
    cpu: dict[str, list[float]] = {k: [] for k in steps}
    wall: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            for ids in batches:
                c0, w0 = time.thread_time(), time.perf_counter()
                fn(ids)
                cpu[name].append(time.thread_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    return {k: (statistics.median(cpu[k]), statistics.median(wall[k])) for k in steps}


def patching_sweep(model, clean: torch.Tensor, corrupt: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Patch the corrupted residual into the clean run at every (layer, position).

    Returns (seconds, effects (n_layers, pos)): effect = mean over items of the L1 change of the last
    position's log-probabilities.
    """
    names = [f"blocks.{i}.hook_resid_pre" for i in range(len(model.blocks))]
    t0 = time.perf_counter()
    _, cache = run_with_cache(model, corrupt, names=names)
    effects = torch.zeros(len(names), clean.shape[1])
    with torch.no_grad():
        base = model(clean)[:, -1].log_softmax(-1)
        for li, name in enumerate(names):
            for p in range(clean.shape[1]):
                with patch(model, {name: patch_positions(cache[name], positions=[p])}):
                    out = model(clean)[:, -1].log_softmax(-1)
                effects[li, p] = (out - base).abs().sum(-1).mean()
    return time.perf_counter() - t0, effects


def patching_sweep_tl(ht, clean: torch.Tensor, corrupt: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The same sweep with TransformerLens's own hooks on a ``HookedTransformer``."""
    names = [f"blocks.{i}.hook_resid_pre" for i in range(ht.cfg.n_layers)]
    t0 = time.perf_counter()
    with torch.no_grad():
        _, cache = ht.run_with_cache(corrupt, names_filter=lambda n: n in names)
        effects = torch.zeros(len(names), clean.shape[1])
        base = ht(clean)[:, -1].log_softmax(-1)
        for li, name in enumerate(names):
            for p in range(clean.shape[1]):

                def hook(act, hook, p=p, name=name):
                    act[:, p] = cache[name][:, p]
                    return act

                out = ht.run_with_hooks(clean, fwd_hooks=[(name, hook)])[:, -1].log_softmax(-1)
                effects[li, p] = (out - base).abs().sum(-1).mean()
    return time.perf_counter() - t0, effects


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds of timed steps")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model per round")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the CPU recipes use 1); 0 = default"
    )
    ap.add_argument("--optimizer", choices=["fused", "loop"], default="fused")
    ap.add_argument("--patch-items", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(
        d_vocab=14, n_ctx=SEQ, n_layers=args.layers, d_model=args.d_model, n_heads=4, d_mlp=4 * args.d_model
    )
    ours, ours_recipe = GPT(cfg), GPT(cfg)
    ours_recipe.load_state_dict(ours.state_dict())
    hf = to_hf_gpt2(ours)
    batches = [torch.randint(0, 14, (args.batch, SEQ)) for _ in range(args.steps)]
    mask = torch.zeros(args.batch, SEQ, dtype=torch.bool)
    mask[:, PROMPT:] = True
    with torch.no_grad():  # same weights -> same logits and loss before timing (float32 op order: 1e-5)
        assert (ours(batches[0]) - hf(batches[0]).logits).abs().max() < 1e-5
        full = _full_loss(ours(batches[0][:, :-1]), batches[0], mask)
        assert abs(answer_loss(ours, _fda_batch(batches[0])).item() - full.item()) < 1e-5
    steps = {
        "hf": make_step(hf, "hf", args.optimizer, mask),
        "model": make_step(ours, "model", args.optimizer, mask),
        "recipe": make_step(ours_recipe, "recipe", args.optimizer, mask),
    }
    t = time_training(steps, batches, args.rounds)
    tokens = args.batch * (SEQ - 1)
    print(
        f"config: layers={args.layers} d_model={args.d_model} batch={args.batch} seq={SEQ} "
        f"threads={torch.get_num_threads()} optimizer={args.optimizer} rounds={args.rounds}x{args.steps} steps"
    )
    print(f"{'training step':<44}{'cpu ms':>9}{'wall ms':>9}{'tokens/cpu-s':>14}")
    labels = {
        "hf": "HF GPT2LMHeadModel (full logits)",
        "model": "ours, full logits (model alone)",
        "recipe": "ours, answer-span logits (recipe's loss)",
    }
    for k, (c, w) in t.items():
        print(f"{labels[k]:<44}{c * 1e3:>9.2f}{w * 1e3:>9.2f}{tokens / c:>14.0f}")
    speed = {k: t["hf"][0] / t[k][0] for k in ("model", "recipe")}
    speed_wall = {k: t["hf"][1] / t[k][1] for k in ("model", "recipe")}
    print(
        f"train speedup vs HF (cpu time): recipe step {speed['recipe']:.2f}x, model alone {speed['model']:.2f}x"
        f"  (wall: {speed_wall['recipe']:.2f}x, {speed_wall['model']:.2f}x)"
    )

    ours.eval()
    gen = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 14, (args.patch_items, SEQ), generator=gen)
    corrupt = torch.randint(0, 14, (args.patch_items, SEQ), generator=gen)
    t_patch, effects = patching_sweep(ours, clean, corrupt)
    assert torch.isfinite(effects).all() and effects.max() > 0  # the sweep must actually change outputs
    grid = f"{args.layers} layers x {SEQ} positions, {args.patch_items} items"
    print(f"patching sweep ({grid}): ours {t_patch:.3f} s")
    result = {
        "train_speedup_vs_hf": round(speed["recipe"], 3),
        "train_speedup_vs_hf_model": round(speed["model"], 3),
        "train_speedup_vs_hf_wall": round(speed_wall["recipe"], 3),
        "ours_recipe_tokens_per_cpu_s": round(tokens / t["recipe"][0]),
        "ours_model_tokens_per_cpu_s": round(tokens / t["model"][0]),
        "hf_tokens_per_cpu_s": round(tokens / t["hf"][0]),
        "patching_sweep_s": round(t_patch, 3),
    }
    if importlib.util.find_spec("transformer_lens") is None:
        print("TransformerLens not installed (pip install 'reprlab[lens]'): patching comparison skipped")
    else:
        from reprlab.interp.lens import to_hooked_transformer

        with warnings.catch_warnings():  # 3.x warns that HookedTransformer goes away in 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            ht = to_hooked_transformer(ours)
            reps = [
                (patching_sweep(ours, clean, corrupt)[0], patching_sweep_tl(ht, clean, corrupt))
                for _ in range(3)
            ]
        t_ours = statistics.median(r[0] for r in reps)
        t_tl = statistics.median(r[1][0] for r in reps)
        diff = (reps[0][1][1] - effects).abs().max().item()
        print(
            f"patching sweep, same model and grid, median of 3: ours {t_ours:.3f} s, TransformerLens {t_tl:.3f} s "
            f"-> ours {t_tl / t_ours:.2f}x faster; max |effect difference| {diff:.2e} (effects up to "
            f"{effects.max().item():.3f})"
        )
        result |= {
            "patching_sweep_s": round(t_ours, 3), "patching_sweep_tl_s": round(t_tl, 3),
            "patching_speedup_vs_tl": round(t_tl / t_ours, 3), "patching_max_abs_diff_vs_tl": diff,
        }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
