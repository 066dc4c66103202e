"""Reason to Rote benchmark: training throughput of our hookable GPT vs HF GPT2LMHeadModel, and the time of a
full activation-patching sweep (ours vs TransformerLens when installed).

Both models get the same configuration and the same initial weights (``to_hf_gpt2``), the same batches, the
answer-only loss and AdamW; we time forward + backward + optimizer step after warm-up steps. HF GPT-2 runs
with its default attention implementation and dropout 0.

Defaults are the rote-fda-tiny model and batch (2 layers, d_model 64, batch 64); ``--layers 4 --d-model 128
--batch 256`` is the brief's tier M.

Usage: python benchmarks/bench_rote.py [--steps 30] [--batch 64] [--layers 2] [--d-model 64] [--threads 0]
Last line printed: one JSON object with ``train_speedup_vs_hf`` and, when measured, ``patching_speedup_vs_tl``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch
import torch.nn.functional as F

from reprlab.hooks import patch, patch_positions, run_with_cache
from reprlab.models.gpt import GPT, GPTConfig, to_hf_gpt2


def _loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])


def time_training(model, batches, mask, is_hf: bool, warmup: int = 3) -> float:
    """Seconds per training step (median of timed steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        out = model(ids[:, :-1])
        logits = out.logits if is_hf else out
        loss = _loss(logits, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def patching_sweep(model, clean: torch.Tensor, corrupt: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Patch the corrupted residual into the clean run at every (layer, position); returns (seconds, effects)."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    seq = 16  # FDA: 10 prompt + 5 digits + EOS
    cfg = GPTConfig(
        d_vocab=14, n_ctx=seq, n_layers=args.layers, d_model=args.d_model, n_heads=4, d_mlp=4 * args.d_model
    )
    ours = GPT(cfg)
    hf = to_hf_gpt2(ours)
    batches = [torch.randint(0, 14, (args.batch, seq)) for _ in range(args.steps)]
    mask = torch.zeros(args.batch, seq, dtype=torch.bool)
    mask[:, 10:] = True
    with torch.no_grad():  # same weights -> same logits before timing (sanity, 1e-4 for float32 op order)
        assert (ours(batches[0]) - hf(batches[0]).logits).abs().max() < 1e-4
    t_hf = time_training(hf, batches, mask, is_hf=True)
    t_ours = time_training(ours, batches, mask, is_hf=False)
    tokens = args.batch * (seq - 1)
    rows = [("ours (GPT, SDPA)", t_ours, tokens / t_ours), ("HF GPT2LMHeadModel", t_hf, tokens / t_hf)]
    print(
        f"config: layers={args.layers} d_model={args.d_model} batch={args.batch} seq={seq} threads={torch.get_num_threads()}"
    )
    print(f"{'model':<22}{'s/step':>10}{'tokens/s':>12}")
    for name, t, tps in rows:
        print(f"{name:<22}{t:>10.4f}{tps:>12.0f}")
    speedup = t_hf / t_ours
    print(f"train speedup vs HF: {speedup:.2f}x")

    ours.eval()
    clean, corrupt = torch.randint(0, 14, (64, seq)), torch.randint(0, 14, (64, seq))
    t_patch, effects = patching_sweep(ours, clean, corrupt)
    assert torch.isfinite(effects).all() and effects.max() > 0  # the sweep must actually change outputs
    print(f"patching sweep ({args.layers} layers x {seq} positions, 64 items): ours {t_patch:.3f} s")
    result = {
        "train_speedup_vs_hf": round(speedup, 3),
        "ours_tokens_per_s": round(tokens / t_ours),
        "hf_tokens_per_s": round(tokens / t_hf),
        "patching_sweep_s": round(t_patch, 3),
    }
    if importlib.util.find_spec("transformer_lens") is None:
        print(
            "TransformerLens not installed: patching comparison skipped "
            "(its install pulls wandb/datasets and ~30 packages into the shared venv; see report)"
        )
    else:  # pragma: no cover - optional dependency
        from transformer_lens import HookedTransformer, HookedTransformerConfig

        tl_cfg = HookedTransformerConfig(
            n_layers=args.layers,
            d_model=args.d_model,
            n_ctx=seq,
            d_head=args.d_model // 4,
            n_heads=4,
            d_mlp=4 * args.d_model,
            d_vocab=14,
            act_fn="gelu_new",
            normalization_type="LN",
        )
        tl = HookedTransformer(tl_cfg).eval()
        names = [f"blocks.{i}.hook_resid_pre" for i in range(args.layers)]
        t0 = time.perf_counter()
        _, cache = tl.run_with_cache(corrupt, names_filter=lambda n: n in names)
        with torch.no_grad():
            for name in names:
                for p in range(seq):

                    def hook(act, hook, p=p, name=name):
                        act[:, p] = cache[name][:, p]
                        return act

                    tl.run_with_hooks(clean, fwd_hooks=[(name, hook)])
        t_tl = time.perf_counter() - t0
        print(f"patching sweep TransformerLens: {t_tl:.3f} s")
        result["patching_speedup_vs_tl"] = round(t_tl / t_patch, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
