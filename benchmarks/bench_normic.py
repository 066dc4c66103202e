"""Norm-IC throughput: batched word-level analysis vs a naive per-word loop, same model, same words.

Both sides extract the last-layer states of each word, compose them (sum, mean, IND, JOINT, CLS) and take
‖v‖²; the naive side runs one forward pass and one composition call per word. The squared norms of the two
sides must agree (printed as max relative difference). Last line: one JSON object with ``speedup_vs_naive``.

    .venv/bin/python benchmarks/bench_normic.py [--model all-minilm-l6-v2] [--arch encoder] [--words 150] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from reprlab.methods.norm_ic.compose import compose  # noqa: E402
from reprlab.methods.norm_ic.extract import extract_states  # noqa: E402
from reprlab.methods.norm_ic.vocab import sample_vocabulary  # noqa: E402

COMPS = ("sum", "mean", "ind", "joint", "pooled")


def batched(model, tok, words, arch, batch_size):
    st = extract_states(model, tok, words, arch, layers=(-1,), batch_size=batch_size)
    x, mask, pooled = st.states[:, 0], st.mask, st.pooled[:, 0]
    return {c: (compose(c, x, mask, pooled=pooled) ** 2).sum(-1).numpy() for c in COMPS}


def naive(model, tok, words, arch):
    out = {c: [] for c in COMPS}
    for w in words:  # one forward pass and one composition per word: what a first script would do
        st = extract_states(model, tok, [w], arch, layers=(-1,), batch_size=1)
        x, mask, pooled = st.states[:, 0], st.mask, st.pooled[:, 0]
        for c in COMPS:
            out[c].append(float((compose(c, x, mask, pooled=pooled) ** 2).sum()))
    return {c: np.array(v) for c, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--arch", default="encoder", choices=["encoder", "decoder"])
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads; 1 is fastest on the shared 2-core box"
    )
    ap.add_argument("--batch-size", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from reprlab.models.hf import load_causal_lm, load_encoder

    model, tok = (load_causal_lm if args.arch == "decoder" else load_encoder)(args.model)
    words = sample_vocabulary(args.words, 0, top_k=30000, seed=0).eval_words
    batched(model, tok, words[:8], args.arch, args.batch_size)  # warm-up: first-call allocations
    t0 = time.perf_counter()
    ours = batched(model, tok, words, args.arch, args.batch_size)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = naive(model, tok, words, args.arch)
    t_ref = time.perf_counter() - t0
    diff = max(float(np.max(np.abs(ours[c] - ref[c]) / np.maximum(np.abs(ref[c]), 1e-12))) for c in COMPS)
    print(f"{'side':<22}{'seconds':>10}{'words/s':>12}")
    print(f"{'batched (ours)':<22}{t_ours:>10.2f}{len(words) / t_ours:>12.1f}")
    print(f"{'naive per-word loop':<22}{t_ref:>10.2f}{len(words) / t_ref:>12.1f}")
    print(f"speedup {t_ref / t_ours:.1f}x; max relative |Δ‖v‖²| between sides {diff:.2e}")
    print(json.dumps({"benchmark": "normic", "model": args.model, "words": len(words),
                      "batched_words_per_s": len(words) / t_ours, "naive_words_per_s": len(words) / t_ref,
                      "speedup_vs_naive": t_ref / t_ours, "max_rel_diff": diff}))  # fmt: skip


if __name__ == "__main__":
    main()
