"""CRL evaluation hot paths on the packaged SmolLM2-135M-Instruct: ours vs the straightforward way, same outputs.

(1) Greedy generation of the crl-tiny prompts (seed 0: 112 base-reply prompts, 16 new tokens): ours (each prompt
prefilled alone, one batched decode with a KV cache) vs transformers' ``generate`` on the left-padded batch (what the
recipe did before) vs ``generate`` one prompt at a time (no padding: the reference for "the same greedy text").
Prints the time of each, and how many replies differ from the one-at-a-time reference and where.
(2) The multiple-choice capability check: ours vs scoring every (question, choice) sequence in padded batches.

Times are wall and CPU seconds of this process (CPU seconds hold up better on a shared machine). Last line: JSON.

    .venv/bin/python benchmarks/bench_crl_eval.py [--threads 1] [--n 112] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from reprlab.methods.crl_safety.capability import _pair, choice_loglik, load_mc, shared_context_loglik  # noqa: E402
from reprlab.methods.crl_safety.chat import ChatFormat, _hf_generate, generate  # noqa: E402
from reprlab.methods.crl_safety.data import make_splits  # noqa: E402
from reprlab.models.hf import load_causal_lm  # noqa: E402


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=112)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--skip-single", action="store_true", help="skip the one-at-a-time reference (slowest)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_causal_lm("smollm2-135m-instruct")
    fmt = ChatFormat(tok, "", 32)  # crl-tiny's data settings
    sp = make_splits(0, 40, 12, 40, 20, 12, "ours")
    prompts = [
        fmt.prompt_ids(p) for p in sp.harmful_train + sp.harmful_eval + sp.harmless_train + sp.harmless_eval
    ]
    prompts = prompts[: args.n]
    ours, w_ours, c_ours = timed(lambda: generate(model, tok, prompts, args.tokens, batch_size=64))

    def padded():
        out = []
        for s in range(0, len(prompts), 64):
            out += [tok.decode(o, skip_special_tokens=True) for o in _hf_generate(model, tok, prompts[s : s + 64],
                                                                                   args.tokens, "cpu")]  # fmt: skip
        return out

    with torch.no_grad():
        pad, w_pad, c_pad = timed(padded)
    rows = [("ours: per-prompt prefill, batched decode", w_ours, c_ours, ours),
            ("transformers generate, left-padded batch", w_pad, c_pad, pad)]  # fmt: skip
    ref = None
    if not args.skip_single:
        with torch.no_grad():
            ref, w_one, c_one = timed(lambda: [tok.decode(_hf_generate(model, tok, [p], args.tokens, "cpu")[0],
                                                          skip_special_tokens=True) for p in prompts])  # fmt: skip
        rows.append(("transformers generate, one prompt at a time", w_one, c_one, ref))
    print(f"{len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.1f} tokens, max "
          f"{max(map(len, prompts))}), {args.tokens} new tokens, {args.threads} thread(s)")  # fmt: skip
    print(f"{'generation':<46}{'wall s':>9}{'cpu s':>9}{'ratio':>8}{'differ':>8}")
    result = {"threads": args.threads, "n_prompts": len(prompts), "new_tokens": args.tokens}
    for name, w, c, texts in rows:
        diff = "-" if ref is None else sum(a != b for a, b in zip(texts, ref))
        print(f"{name:<46}{w:>9.1f}{c:>9.1f}{c / c_ours:>8.2f}{diff:>8}")
        result[name.split(":")[0].split(",")[0].replace(" ", "_") + "_" + name.split(",")[-1].strip().replace(" ", "_")] = {
            "wall_s": w, "cpu_s": c, "differ_from_one_at_a_time": diff}  # fmt: skip
    if ref is not None:
        for name, _, _, texts in rows[:2]:
            for i, (a, b) in enumerate(zip(texts, ref)):
                if a != b:
                    ia, ib = tok.encode(a, add_special_tokens=False), tok.encode(b, add_special_tokens=False)
                    print(f"  {name.split(',')[0]}: prompt {i} differs from token {first_difference(ia, ib)}: "
                          f"{a[:60]!r} vs {b[:60]!r}")  # fmt: skip
    result["speedup_cpu_vs_padded"] = c_pad / c_ours

    items = load_mc()  # the packaged 40 questions x 4 choices
    pairs = [
        _pair(tok, f"Question: {it['question']}\nAnswer:", f" {c}") for it in items for c in it["choices"]
    ]
    ll_ours, w_mo, c_mo = timed(lambda: shared_context_loglik(model, tok, pairs))
    with torch.no_grad():
        ll_ref, w_mr, c_mr = timed(lambda: choice_loglik(model, tok, pairs, 16))

    def acc(ll):
        at, hits = 0, 0
        for it in items:
            k = len(it["choices"])
            hits += max(range(k), key=lambda j: ll[at + j]) == it["answer"]
            at += k
        return hits / len(items)

    gap = max(abs(a - b) for a, b in zip(ll_ours, ll_ref))
    print(f"{'multiple choice (40 x 4)':<46}{'wall s':>9}{'cpu s':>9}{'ratio':>8}{'acc':>8}")
    print(
        f"{'ours: each context once, KV cache per choice':<46}{w_mo:>9.1f}{c_mo:>9.1f}{1.0:>8.2f}{acc(ll_ours):>8.3f}"
    )
    print(
        f"{'every sequence, padded batches of 16':<46}{w_mr:>9.1f}{c_mr:>9.1f}{c_mr / c_mo:>8.2f}{acc(ll_ref):>8.3f}"
    )
    print(f"max |log-likelihood difference| {gap:.2e}")
    result["mc"] = {"ours_cpu_s": c_mo, "padded_cpu_s": c_mr, "speedup_cpu": c_mr / c_mo, "acc_ours": acc(ll_ours),
                    "acc_padded": acc(ll_ref), "max_abs_loglik_diff": gap}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
