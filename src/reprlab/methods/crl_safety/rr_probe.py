"""Why RR (circuit breakers) does or does not move: a short RR-only run with per-term gradient norms [ours].

Trains RR's LoRA on SmolLM2 (or the tiny test Llama) with crl-tiny's RR settings on a small batch set and prints,
per step, the reroute term (mean ReLU(centred cos(h', h))), its per-layer mean cosine, the retain term, and for the
first steps the gradient norms on the LoRA parameters of the two *weighted* terms (c_reroute * reroute and
c_retain * retain), plus the centred and raw norms of the frozen harmful states at the reroute layers.

    HF_HUB_OFFLINE=1 python -m reprlab.methods.crl_safety.rr_probe --retain-scale l2 --steps 6
    HF_HUB_OFFLINE=1 python -m reprlab.methods.crl_safety.rr_probe --retain-scale relative --steps 12
    HF_HUB_OFFLINE=1 python -m reprlab.methods.crl_safety.rr_probe --retain-scale relative --retain-weight 3 --steps 32 --eval-every 8 --grad-steps 0

``--eval-every`` adds held-out centred cos(trained, frozen) on harmful and harmless prompts (selectivity: harmful
should move, benign stay); every step also prints ``train_benign_cos`` at the reroute layers.

Data: seed-0 splits of 12 harmful / 12 harmless training prompts and 6 / 6 held-out ones (4 / 4 before
``--eval-every`` was added: the seed-0 draw of the training prompts changed with it, so the gradient-norm numbers in
the README's "Why RR did not move" points 1-3 came from a different 12 + 12); the model's own 16-token replies (harmful prompts
-> its replies, whether they comply or not: the probe is about the optimisation, not the data); the retain set adds
harmful prompt -> templated refusal pairs (CB's retain data hold refusals).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from reprlab.jsonfile import dumps_json


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="smollm2-135m-instruct", help="packaged alias, folder, or 'tiny-llama'"
    )
    ap.add_argument(
        "--retain-scale", default="l2", choices=("l2", "relative"), help="defense.rr.retain_scale"
    )
    ap.add_argument(
        "--steps", type=int, default=8, help="steps to run (the schedule's N stays --schedule-steps)"
    )
    ap.add_argument("--schedule-steps", type=int, default=32, help="N of CB's schedule (crl-tiny: 32)")
    ap.add_argument("--lr", type=float, default=2e-3, help="AdamW lr (crl-tiny: 2e-3)")
    ap.add_argument(
        "--alpha", type=float, default=10.0, help="defense.rr.alpha (CB schedule scale; crl-tiny: 10)"
    )
    ap.add_argument("--retain-weight", type=float, default=1.0, help="defense.rr.retain_weight (crl-tiny: 1)")
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every N steps (and after the last) print held-out centred cos(trained, frozen) on harmful and "
        "harmless prompts at crl-tiny's mechanism layers (third, two_thirds, -2), as rr.mech_cos_*; 0 = off",
    )
    ap.add_argument(
        "--b-std", type=float, default=0.0, help="[probe only] random init std of LoRA B (0 = peft's B = 0)"
    )
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument(
        "--grad-steps", type=int, default=4, help="report per-term gradient norms for this many steps"
    )
    args = ap.parse_args(argv)

    from reprlab.methods.crl_safety import losses as L
    from reprlab.methods.crl_safety.chat import ChatFormat, generate
    from reprlab.methods.crl_safety.config import DefenseCfg, OptimCfg, RrCfg
    from reprlab.methods.crl_safety.data import REFUSALS, make_splits
    from reprlab.methods.crl_safety.layers import num_layers, parse_layers
    from reprlab.methods.crl_safety.metrics import mechanism
    from reprlab.methods.crl_safety.trainer import Trainer, lora_blocks, state_means
    from reprlab.models.lora import add_lora

    torch.set_num_threads(1)
    t0 = time.time()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.model == "tiny-llama":
        from reprlab.models.hf import tiny_llama

        model, tok = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)
        model = model.to(dtype)
    else:
        from reprlab.models.hf import load_causal_lm

        model, tok = load_causal_lm(args.model, dtype=dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    fmt = ChatFormat(tok, "", 32)
    sp = make_splits(0, 12, 6, 12, 6, 4, "ours")
    hr = generate(model, tok, [fmt.prompt_ids(p) for p in sp.harmful_train], 16, batch_size=64)
    br = generate(model, tok, [fmt.prompt_ids(p) for p in sp.harmless_train], 16, batch_size=64)

    def pair(p, r, end):
        return fmt.prompt_ids(p), fmt.response_ids(p, r, end_turn=end, max_tokens=16)

    harm = [pair(p, r, False) for p, r in zip(sp.harmful_train, hr)]
    ben = [pair(p, r, False) for p, r in zip(sp.harmless_train, br)]
    ben += [pair(p, REFUSALS[i % len(REFUSALS)], True) for i, p in enumerate(sp.harmful_train)]
    cfg = DefenseCfg(optim=OptimCfg(steps=args.schedule_steps, batch_size=4, lr=args.lr, checkpoint_every=10**6),
                     rr=RrCfg(retain_scale=args.retain_scale, alpha=args.alpha,
                              retain_weight=args.retain_weight))  # fmt: skip
    n = num_layers(model)
    torch.manual_seed(0)
    peft = add_lora(model, 16, 16, 0.05, "all-linear", lora_blocks("auto", "rr", cfg, n), adapter_name="rr")
    if args.b_std:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * args.b_std)
    with peft.disable_adapter():
        center = state_means(peft, harm, ben, tok.pad_token_id)
    tr = Trainer("rr", peft, cfg, harm, ben, tok.pad_token_id, None, seed=0, center=center)
    if args.eval_every:  # held-out prompts with the model's own replies, as the recipe's mechanism metric
        he = generate(model, tok, [fmt.prompt_ids(p) for p in sp.harmful_eval], 16, batch_size=64)
        be = generate(model, tok, [fmt.prompt_ids(p) for p in sp.harmless_eval], 16, batch_size=64)
        heval = [pair(p, r, False) for p, r in zip(sp.harmful_eval, he)]
        beval = [pair(p, r, False) for p, r in zip(sp.harmless_eval, be)]
        mech_layers = parse_layers("third,two_thirds,-2", n)
    lh, lb = tr.layers["harmful"], tr.layers["benign"]
    print(f"setup {time.time() - t0:.0f}s {vars(args)} reroute layers {lh}", flush=True)
    peft.train()

    def gnorm(t):
        gs = torch.autograd.grad(t, tr.params, retain_graph=True, allow_unused=True)
        return sum(float(x.float().norm() ** 2) for x in gs if x is not None) ** 0.5

    rows = []
    for step in range(args.steps):
        c_ret, c_rr = L.rr_coefficients(step, tr.steps, cfg.rr.alpha)
        c_ret *= cfg.rr.retain_weight
        tr.opt.zero_grad(set_to_none=True)
        ih, ib = tr._sample(tr.harmful), tr._sample(tr.benign)
        bh, bb = tr._batch(tr.harmful, ih), tr._batch(tr.benign, ib)
        oh = tr._fwd(bh, logits_last=1)
        hh = L.select_tokens(oh.hidden_states, lh, tr._token_mask(bh, "harmful"))
        fh, _ = tr._frozen_rows("harmful", tr.harmful, ih, bh, logits=False)
        cos = F.cosine_similarity(tr._c(hh, lh).float(), tr._c(fh, lh).float(), dim=-1)  # [layers, tokens]
        reroute = torch.relu(cos).mean()
        ob = tr._fwd(bb, logits_last=1)
        hb = L.select_tokens(ob.hidden_states, lb, tr._token_mask(bb, "benign")).float()
        fb, _ = tr._frozen_rows("benign", tr.benign, ib, bb, logits=False)
        retain = L.rr_retain_loss(hb, fb.float(), args.retain_scale)
        # training benign (harmless + refusal) tokens at the reroute layers: what selectivity keeps near 1
        hbr = L.select_tokens(ob.hidden_states, lh, tr._token_mask(bb, "benign")).detach()
        fbr = fb[[lb.index(i) for i in lh]]
        cos_b = F.cosine_similarity(tr._c(hbr, lh).float(), tr._c(fbr, lh).float(), dim=-1).mean().item()
        row = {"step": step, "reroute": reroute.item(), "cos_per_layer": cos.mean(1).tolist(), "retain": retain.item(),
               "train_benign_cos": cos_b,
               "c_reroute": c_rr, "c_retain": c_ret}  # fmt: skip
        if step < args.grad_steps:
            row["grad_reroute"] = gnorm(c_rr * reroute)
            row["grad_retain"] = gnorm(c_ret * retain) if c_ret else 0.0
            row["centred_norm"] = tr._c(fh, lh).float().norm(dim=-1).mean(1).tolist()
            row["raw_norm"] = fh.float().norm(dim=-1).mean(1).tolist()
        (c_ret * retain + c_rr * reroute).backward()
        tr.opt.step()
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            peft.eval()
            m = mechanism(peft, heval, beval, tok.pad_token_id, mech_layers, peft.disable_adapter())
            peft.train()
            row["eval_cos_harmful"] = sum(m["cos_harmful_centered"]) / len(mech_layers)
            row["eval_cos_benign"] = sum(m["cos_benign_centered"]) / len(mech_layers)
            row["eval_per_layer"] = {"harmful": m["cos_harmful_centered"], "benign": m["cos_benign_centered"]}
        rows.append(row)
        print(dumps_json(row, indent=None), flush=True)
    print(f"total {time.time() - t0:.0f}s")
    return rows


if __name__ == "__main__":
    main()
