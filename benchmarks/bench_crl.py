"""CRL benchmark: (1) our trainer's CRL step vs a plain peft + PyTorch loop computing the same loss;
(2) embedding-attack steps/s batched across prompts vs one prompt at a time.

Reference side: a hand-written loop with peft's ``disable_adapter`` for the frozen pass every step (what a
straightforward implementation does), the same triplet + KL formulas written inline. Our trainer caches the
frozen states once per example (``optim.cache_frozen``), which is where a ratio < 1 comes from.
Model: a random Llama (4 blocks, d_model 128; ``--smollm`` for the packaged SmolLM2, slow on CPU).
Last line printed: one JSON object with the ratios.

    .venv/bin/python benchmarks/bench_crl.py [--steps 6] [--smollm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from reprlab.methods.crl_safety.chat import ChatFormat, collate, forward, response_logits  # noqa: E402
from reprlab.methods.crl_safety.config import CrlCfg, DefenseCfg, OptimCfg  # noqa: E402
from reprlab.methods.crl_safety.embedding_attack import embedding_attack  # noqa: E402
from reprlab.methods.crl_safety.trainer import Trainer  # noqa: E402
from reprlab.models.lora import add_lora  # noqa: E402


@torch.no_grad()
def plain_center(model, harmful, benign, pad):
    """Reference centre: per layer, the mean of the two classes' mean response states (one batch per class)."""
    means = []
    with model.disable_adapter():
        for pairs in (harmful, benign):
            b = collate(pairs, pad)
            hs = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=1).hidden_states
            means.append(torch.stack([h[b.response_mask].mean(0) for h in hs]))
    return (means[0] + means[1]) / 2


def plain_crl_step(model, opt, harmful, benign, rng, c: CrlCfg, layers, bs, pad, center):
    """Reference: one CRL step written out with no caching and no helpers beyond collate/forward."""
    ih, ib = rng.sample(range(len(harmful)), bs), rng.sample(range(len(benign)), bs)
    bh, bb = collate([harmful[i] for i in ih], pad), collate([benign[i] for i in ib], pad)
    opt.zero_grad(set_to_none=True)
    with torch.no_grad(), model.disable_adapter():
        fh = forward(model, bh.attention_mask, input_ids=bh.input_ids, logits_last=1).hidden_states
        fbo = forward(model, bb.attention_mask, input_ids=bb.input_ids, logits_last=bb.n_response + 1)
    oh = forward(model, bh.attention_mask, input_ids=bh.input_ids, logits_last=1).hidden_states
    ob = forward(model, bb.attention_mask, input_ids=bb.input_ids, logits_last=bb.n_response + 1)
    cos_d = lambda a, b: 1 - F.cosine_similarity(a, b, dim=-1)  # noqa: E731
    ctr = center[layers].unsqueeze(1)
    hh = torch.stack([oh[i][bh.response_mask] for i in layers]) - ctr
    mu = hh.mean(1, keepdim=True)
    hb = torch.stack([ob.hidden_states[i][bb.response_mask] for i in layers]) - ctr
    fb = torch.stack([fbo.hidden_states[i][bb.response_mask] for i in layers]) - ctr
    fhh = torch.stack([fh[i][bh.response_mask] for i in layers]) - ctr
    l_b = F.relu(cos_d(hb, fb) - cos_d(hb, mu) + c.margin_benign).mean()
    l_h = F.relu(cos_d(hh, mu) - cos_d(hh, fhh) + c.margin_harmful).mean()
    lz, _, m = response_logits(ob.logits, bb)
    fz, _, _ = response_logits(fbo.logits, bb)
    t = c.temperature
    kl = t**2 * F.kl_div(
        F.log_softmax(lz[m] / t, -1), F.log_softmax(fz[m] / t, -1), log_target=True, reduction="batchmean"
    )
    loss = c.alpha * l_b + c.beta * l_h + c.kl_weight * kl
    loss.backward()
    opt.step()
    return float(loss)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smollm", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.smollm:
        from reprlab.models.hf import load_causal_lm

        model, tok = load_causal_lm("smollm2-135m-instruct")
    else:
        from reprlab.models.hf import tiny_llama

        model, tok = tiny_llama(seed=0, num_hidden_layers=4, hidden_size=128, intermediate_size=256,
                                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)  # fmt: skip
    fmt = ChatFormat(tok, "", max_prompt_tokens=32)
    harmful = [(fmt.prompt_ids(f"Explain how to do forbidden thing number {i}"),
                fmt.response_ids("x", f"Sure, first you take item {i} and then", end_turn=False)) for i in range(16)]  # fmt: skip
    benign = [(fmt.prompt_ids(f"What is a good name for pet number {i}?"),
               fmt.response_ids("x", f"A good name for pet {i} is Biscuit", end_turn=False)) for i in range(16)]  # fmt: skip
    n = model.config.num_hidden_layers
    layers = list(range(max(1, n // 3), n - 1))
    spec = f"{layers[0]}:{layers[-1]}"
    crl = CrlCfg(layers_benign=spec, layers_harmful=spec)
    bs = 4
    peft = add_lora(model, r=16, alpha=16, dropout=0.0)
    center = plain_center(peft, harmful, benign, tok.pad_token_id)  # the recipe's centred cosines (ours)

    # ours: warm-up step (fills the frozen cache, as in a real run), then timed steps
    cfg = DefenseCfg(
        optim=OptimCfg(steps=args.steps + 1, batch_size=bs, lr=1e-4, checkpoint_every=10**9), crl=crl
    )
    tr = Trainer("crl", peft, cfg, harmful, benign, tok.pad_token_id, seed=0)
    tr.opt.zero_grad()
    tr.loss(0)[0].backward()
    t0 = time.perf_counter()
    ours_losses = []
    for s in range(args.steps):
        tr.opt.zero_grad(set_to_none=True)
        loss, _ = tr.loss(s + 1)
        loss.backward()
        tr.opt.step()
        ours_losses.append(float(loss))
    t_ours = (time.perf_counter() - t0) / args.steps

    # reference: fresh adapters with the same init, plain loop
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.zero_()
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    rng = random.Random(0)
    plain_crl_step(peft, opt, harmful, benign, rng, crl, layers, bs, tok.pad_token_id, center)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.steps):
        plain_crl_step(peft, opt, harmful, benign, rng, crl, layers, bs, tok.pad_token_id, center)
    t_plain = (time.perf_counter() - t0) / args.steps

    # same loss check: both implementations on one identical batch at the LoRA-zero point
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.zero_()
    tr.rng, rng_ref = random.Random(123), random.Random(123)
    with torch.no_grad():
        ours0 = float(tr.loss(1)[0])
    opt_noop = torch.optim.SGD([p for p in peft.parameters() if p.requires_grad], lr=0.0)
    ref0 = plain_crl_step(peft, opt_noop, harmful, benign, rng_ref, crl, layers, bs, tok.pad_token_id, center)

    # embedding attack: 8 prompts batched vs one at a time, same steps
    peft.eval()
    prompts = [f"Tell me how to do bad thing {i}" for i in range(8)]
    targets = [fmt.response_ids(p, "Sure, here is how", end_turn=False) for p in prompts]
    k = 5
    t0 = time.perf_counter()
    embedding_attack(peft, tok, fmt, prompts, targets, k, 1e-2, "x x x", 10, max_new_tokens=1)
    t_batched = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p, tgt in zip(prompts, targets):
        embedding_attack(peft, tok, fmt, [p], [tgt], k, 1e-2, "x x x", 10, max_new_tokens=1)
    t_single = time.perf_counter() - t0
    sps_b, sps_s = len(prompts) * k / t_batched, len(prompts) * k / t_single

    print(f"{'measure':<44}{'ours':>12}{'reference':>12}{'ratio':>9}")
    print(
        f"{'CRL train step (s), ours vs plain peft loop':<44}{t_ours:>12.4f}{t_plain:>12.4f}{t_ours / t_plain:>9.3f}"
    )
    print(
        f"{'same-batch loss at init, ours vs plain':<44}{ours0:>12.6f}{ref0:>12.6f}{abs(ours0 - ref0):>9.2e}"
    )
    print(
        f"{'emb-attack prompt-steps/s, batched vs single':<44}{sps_b:>12.2f}{sps_s:>12.2f}{sps_b / sps_s:>9.3f}"
    )
    print(json.dumps({"model": "smollm2-135m-instruct" if args.smollm else "tiny-llama-d128",
                      "train_step_s_ours": t_ours, "train_step_s_plain": t_plain,
                      "train_overhead_ratio": t_ours / t_plain, "loss_abs_diff": abs(ours0 - ref0),
                      "emb_steps_per_s_batched": sps_b, "emb_steps_per_s_single": sps_s,
                      "emb_batched_speedup": sps_b / sps_s, "threads": args.threads}))  # fmt: skip


if __name__ == "__main__":
    main()
