"""OTCCLIP cost: training-epoch overhead vs plain CLIP, and re-matching throughput vs POT.

1. Epoch time (process CPU time) of the same tiny CLIP on the same poisoned mosaics, plain CLIP (defense
   "none") vs OTCCLIP (a non-matching epoch with the inter/intra OT losses, and a matching epoch with OT
   re-ranking), all variants interleaved within each of several repeats; each ratio is the variant's epoch
   over the plain-CLIP epoch of the same repeat, reported as the median [min - max] over repeats (a shared
   machine's load moves both sides of a repeat alike). The target [ours]: overhead ratio <= 1.15. Variants:
   the defaults (otcclip-mosaic-tiny's defense settings); ``_intra16``: the recipe's ``intra_subset`` before the
   third set of speed changes (16; now 12); ``_views_floor``: no inter term and one Sinkhorn iteration for the intra term (not a
   setting to train with: what the second views and re-matching cost without the OT-loss solves); ``_prev3``:
   that and the third set of speed switches off (``reprlab.ot.sinkhorn.RETIRE_CONVERGED``,
   ``defenses.matching.SKIP_OWN_DUPLICATE``, ``defenses.otcclip.POOL_SKIPS_INTRA_ROWS``: the step before that
   round); ``_prev``: the second round's switches off too (``reprlab.ot.sinkhorn.NUMPY_SMALL``,
   ``defenses.matching.POOL_EVAL_FORWARD``, ``defenses.losses.GROUPED_COSINE_GRAD``: the step before that
   round);
   ``_unfused``: the first round's options off too (the step before the speed options, same weights
   bitwise); ``topk16``; fixed-50-iteration matching / loss OT.
   The same after 3 trained epochs (``epoch_overhead_ratio_trained``); ``loss_tol_vs_fixed50_epoch``: the
   training-loss OT to ``loss_tol`` vs the old fixed 50 iterations.
2. Re-matching OT convergence: the configured tolerance solve (``match_tol`` 1e-3, at most
   ``match_max_iters`` 1000) vs the old fixed 50 iterations, on clustered sets (like trained features):
   largest marginal error and cost error vs a reference solve, and time; plus a matching epoch's time
   with each (``matching_epoch_tol_vs_fixed50``).
   Training-loss OT convergence: ``loss_tol`` 1e-2 (at most 200 iterations) vs fixed 50 on the intra text
   problems of a fresh model (the slowest case).
3. Re-ranking B images x k shortlisted captions by the patch-token OT distance: our batched
   ``reprlab.ot.ot_distance`` vs POT ``ot.sinkhorn2`` (log-domain) called per pair, same eps and
   iterations; the costs are compared too.

4. ``--scaling``: epoch time against data size (``n_pairs`` 250 ... 4,000, the same testbed generator, model and
   defence settings) for plain CLIP, an OTCCLIP non-matching and an OTCCLIP matching epoch, with a least-squares
   line ``t = a + c n`` per variant and the marginal per-pair cost between the two largest sizes, so the time of a
   larger run of this model can be predicted. Re-matching compares each image with the batch's captions plus the
   caption bank (FIFO, ``bank_size`` 2,048), which holds ``min(n, 2048)`` captions after the first epoch: below
   about 2,048 pairs the matching epoch's per-pair cost still grows with ``n``, above it is constant, so the
   marginal cost of the largest sizes is the one to extrapolate with.

Run: ``python benchmarks/bench_otcclip.py`` (about 3-8 minutes on 2 loaded CPU cores); ``--scaling`` (about 5
minutes). The last line is JSON.
"""

from __future__ import annotations

import importlib
import json
import time
import warnings
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import DataConfig, DefenseConfig, ModelConfig, OTConfig, TrainConfig
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.defenses.losses import ot_distances, ot_solve
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training.augment import drop_words
from reprlab.methods.otcclip.training.trainer import Trainer

# The [ours, speed] switches, grouped by the round that added them (docs/otcclip_ablation.md), for the "before"
# variants. Second round: NumPy small-problem Sinkhorn blocks, the eval-mode pool encode, the one-node
# cosine/envelope backward of the OT losses. Third round: per-problem retirement in tolerance solves, no duplicate own-caption solve in
# re-matching, the pool reusing the intra term's own-caption rows.
_SWITCHES = {
    2: (
        ("reprlab.ot.sinkhorn", "NUMPY_SMALL"),
        ("reprlab.methods.otcclip.defenses.matching", "POOL_EVAL_FORWARD"),
        ("reprlab.methods.otcclip.defenses.losses", "GROUPED_COSINE_GRAD"),
    ),
    3: (
        ("reprlab.ot.sinkhorn", "RETIRE_CONVERGED"),
        ("reprlab.methods.otcclip.defenses.matching", "SKIP_OWN_DUPLICATE"),
        ("reprlab.methods.otcclip.defenses.otcclip", "POOL_SKIPS_INTRA_ROWS"),
    ),
}


def _set_switches(level: int) -> list:
    """Turn on the speed switch sets up to ``level`` (3: all, the defaults; 2: the third set's
    off; 1: the second's off too); return the previous values for :func:`_set_switches_back`."""
    prev = []
    for rnd, switches in _SWITCHES.items():
        for module, name in switches:
            m = importlib.import_module(
                module
            )  # the module (``reprlab.ot.sinkhorn`` is also a function name)
            prev.append((m, name, getattr(m, name)))
            setattr(m, name, rnd <= level)
    return prev


def epoch_times(n_pairs: int = 500, repeats: int = 5, trained_epochs: int = 0) -> dict[str, list[float]]:
    """CPU time of one epoch per variant, ``repeats`` times, the variants interleaved within each repeat (so a
    repeat's ratios compare epochs run under the same machine load). ``trained_epochs`` > 0: every trainer first
    trains that many epochs (features as later in a run, where the OT solves converge differently) and the timed
    epochs are the next non-matching / matching ones. Each repeat trains the trainer one more epoch (of the same
    kind), as a run would."""
    bed = build_testbed(
        DataConfig(
            n_pairs=n_pairs,
            max_items=2,
            captions_per_target=10,
            backdoor_pairs=20,
            n_eval=10,
            n_probe_train=10,
        ),
        seed=0,
    )
    tok = WordTokenizer.from_texts(bed.pairs.captions)
    mcfg, tcfg = ModelConfig(patch_size=14), TrainConfig(epochs=4, batch_size=50, warmup_steps=5)
    # the recipe's defense settings (otcclip-mosaic-tiny: top_k 4, keep_margin 0.05, intra_subset 12), matching from
    # epoch 1
    dcfg = DefenseConfig(
        bank_size=2048, top_k=4, keep_margin=0.05, intra_subset=12, rematch_warmup=1, rematch_every=2
    )
    intra16 = replace(dcfg, intra_subset=16)  # otcclip-mosaic-tiny before the third switch set
    # a floor, not a setting to train with: no inter term and one Sinkhorn iteration for the intra term, so
    # the epoch pays for the second views (and re-matching) but almost nothing for the OT losses
    floor = replace(dcfg, lambda_inter=0.0, ot=replace(dcfg.ot, loss_tol=None, n_iters=1))
    fixed = replace(dcfg, ot=replace(dcfg.ot, match_tol=None))  # the old matching: 50 fixed iterations
    fixed_loss = replace(dcfg, ot=replace(dcfg.ot, loss_tol=None))  # the old loss OT: 50 fixed iterations
    # the first-pass speed options off: the step before any speed switch (bitwise the same weights)
    unfused = replace(intra16, fused_ot_losses=False, reuse_own_text=False, fused_encoders=False)
    # (label, defense, matching epoch?, config, speed switch sets on (see _set_switches))
    runs = (
        ("clip", "none", 0, dcfg, 3),
        ("otc", "otcclip", 0, dcfg, 3),
        ("otc_match", "otcclip", 1, dcfg, 3),
        ("otc_views_floor", "otcclip", 0, floor, 3),  # what the intra term's second views alone cost
        ("otc_match_views_floor", "otcclip", 1, floor, 3),
        ("otc_intra16", "otcclip", 0, intra16, 3),  # the recipe's earlier intra_subset
        ("otc_match_intra16", "otcclip", 1, intra16, 3),
        ("otc_prev3", "otcclip", 0, intra16, 2),  # and the third set's switches off
        ("otc_match_prev3", "otcclip", 1, intra16, 2),
        ("otc_prev", "otcclip", 0, intra16, 1),  # the second round's off too
        ("otc_match_prev", "otcclip", 1, intra16, 1),
        ("otc_unfused", "otcclip", 0, unfused, 1),
        ("otc_match_unfused", "otcclip", 1, unfused, 1),
        ("otc_match_fixed50", "otcclip", 1, fixed, 3),
        (
            "otc_match_topk16",
            "otcclip",
            1,
            replace(dcfg, top_k=16),
            3,
        ),  # the shortlist before the ablation
        ("otc_fixed50loss", "otcclip", 0, fixed_loss, 3),
        ("otc_match_fixed50loss", "otcclip", 1, fixed_loss, 3),
    )
    if trained_epochs:
        tcfg = replace(tcfg, epochs=trained_epochs + 4 + repeats)
    trainers = []
    for label, defense, kind, dc, switches in runs:
        torch.manual_seed(0)
        tr = Trainer(TinyCLIP(mcfg, len(tok)), bed.pairs, tok, defense, tcfg, dc, seed=0)
        prev = _set_switches(switches)
        try:
            for e in range(trained_epochs):
                tr.run_epoch(e)
            if trained_epochs:  # the next epoch of the wanted kind (W = 1, R = 2: odd epochs match)
                epoch = _next(trained_epochs, kind)
            else:
                epoch = kind
                if kind:
                    tr.run_epoch(0)  # fill the bank as in a real run
        finally:
            _set_switches_back(prev)
        trainers.append((label, tr, epoch, switches))
    out: dict[str, list[float]] = {label: [] for label, *_ in runs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # unconverged-OT warnings of the timed epochs
        for _ in range(repeats):
            for label, tr, epoch, switches in trainers:
                prev = _set_switches(switches)
                try:
                    t = time.process_time()
                    tr.run_epoch(epoch)
                    out[label].append(time.process_time() - t)
                finally:
                    _set_switches_back(prev)
    return out


def _set_switches_back(prev: list) -> None:
    for m, name, value in prev:
        setattr(m, name, value)


def ratio_stats(times: dict[str, list[float]], *labels: str) -> tuple[float, float, float]:
    """Per repeat, the mean epoch time of ``labels`` over the same repeat's plain-CLIP epoch; returns the
    median, min and max over repeats."""
    r = [float(np.mean([times[k][i] for k in labels])) / c for i, c in enumerate(times["clip"])]
    return float(np.median(r)), min(r), max(r)


def _next(start: int, kind: int) -> int:
    """The first epoch >= ``start`` that matches (``kind`` 1) or not (``kind`` 0) when W = 1, R = 2."""
    return start if start % 2 == kind else start + 1


def clustered_sets(batch: int, n: int, m: int, d: int = 64, k: int = 4, spread: float = 0.3, seed: int = 0):
    """Patch/token sets around ``k`` shared directions (like trained features, where Sinkhorn is slowest)."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(k, d, generator=g), dim=-1)

    def draw(size):
        noise = spread * torch.randn(batch, size, d, generator=g) / d**0.5
        return F.normalize(centres[torch.randint(0, k, (batch, size), generator=g)] + noise, dim=-1)

    x, y = draw(n), draw(m)
    lengths = torch.randint(4, m + 1, (batch,), generator=g)
    return x, y, torch.arange(m)[None] < lengths[:, None]


def match_convergence(batch: int = 32 * 17, n: int = 16, m: int = 14) -> list[dict]:
    """Re-matching OT as configured (tol 1e-3, <= 1000 iterations) vs the old fixed 50 iterations, on
    clustered sets: largest marginal error, largest cost error vs a reference run to 1e-7, time."""
    x, y, y_mask = clustered_sets(batch, n, m)
    rows = []
    for eps in (0.05, 0.02):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            ref = ot_solve(
                x, y, None, y_mask, OTConfig(eps=eps, match_tol=1e-7, match_max_iters=10_000), True
            )
            for label, cfg in (
                ("fixed 50", OTConfig(eps=eps, match_tol=None)),
                ("tol 1e-3", OTConfig(eps=eps)),
            ):
                times = []
                for _ in range(2):
                    t = time.perf_counter()
                    res = ot_solve(x, y, None, y_mask, cfg, matching=True)
                    times.append(time.perf_counter() - t)
                rows.append(
                    {
                        "eps": eps,
                        "solve": label,
                        "iters": res.n_iters,
                        "max_marginal_error": float(res.marginal_error.max()),
                        "max_cost_error": float((res.cost - ref.cost).abs().max()),
                        "converged_share": float(res.converged.float().mean()),
                        "seconds": min(times),
                    }
                )
    return rows


def loss_convergence(batch: int = 64) -> list[dict]:
    """Training-loss OT as configured (``loss_tol`` 1e-2, at most ``loss_max_iters`` 200) vs the old fixed 50
    iterations, on the intra text term's problems at initialisation (a caption's tokens vs a word-dropout view
    of it, fresh TinyCLIP: the slowest case measured in training): largest marginal error, cost error and
    loss error vs a reference run to 1e-7, and time."""
    bed = build_testbed(
        DataConfig(
            n_pairs=200, max_items=2, captions_per_target=5, backdoor_pairs=5, n_eval=10, n_probe_train=10
        ),
        seed=0,
    )
    tok = WordTokenizer.from_texts(bed.pairs.captions)
    torch.manual_seed(0)
    model = TinyCLIP(ModelConfig(patch_size=14), len(tok))
    ids, mask = tok.encode(bed.pairs.captions[:batch], model.cfg.max_len)
    g = torch.Generator().manual_seed(0)
    ids1, mask1 = drop_words(ids, mask, g, 0.1)
    ids2, mask2 = drop_words(ids, mask, g, 0.1)
    with torch.no_grad():
        t1, t2 = model.encode_text(ids1, mask1), model.encode_text(ids2, mask2)
    x, y, xm, ym = t1.tokens, t2.tokens, mask1, mask2
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref = ot_solve(x, y, xm, ym, OTConfig(loss_tol=1e-7, loss_max_iters=20_000))
        for label, cfg in (("fixed 50", OTConfig(loss_tol=None)), ("tol 1e-2", OTConfig())):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                res = ot_solve(x, y, xm, ym, cfg)
                times.append(time.perf_counter() - t)
            rows.append(
                {
                    "solve": label,
                    "iters": res.n_iters,
                    "max_marginal_error": float(res.marginal_error.max()),
                    "max_cost_error": float((res.cost - ref.cost).abs().max()),
                    "loss_error": float((res.cost.mean() - ref.cost.mean()).abs()),
                    "seconds": min(times),
                }
            )
    return rows


def rematch_throughput(
    batch: int = 32, k: int = 16, n: int = 16, m: int = 14, d: int = 64, eps: float = 0.05, n_iters: int = 50
) -> dict[str, float]:
    import ot as pot

    g = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(batch * k, n, d, generator=g), dim=-1)
    y = F.normalize(torch.randn(batch * k, m, d, generator=g), dim=-1)
    lengths = torch.randint(4, m + 1, (batch * k,), generator=g)
    y_mask = torch.arange(m)[None] < lengths[:, None]
    cfg = OTConfig(eps=eps, n_iters=n_iters)
    ot_distances(x[:8], y[:8], None, y_mask[:8], cfg)  # warm-up
    t = time.perf_counter()
    ours = ot_distances(x, y, None, y_mask, cfg)
    t_ours = time.perf_counter() - t
    xs, ys = x.double().numpy(), y.double().numpy()
    t = time.perf_counter()
    ref = []
    for i in range(batch * k):
        yv = ys[i, : int(lengths[i])]
        cost = 1.0 - xs[i] @ yv.T
        a, b = np.full(n, 1.0 / n), np.full(len(yv), 1.0 / len(yv))
        plan = pot.sinkhorn(a, b, cost, reg=eps, method="sinkhorn_log", numItermax=n_iters, stopThr=0.0)
        ref.append(float((plan * cost).sum()))
    t_pot = time.perf_counter() - t
    diff = float(np.max(np.abs(ours.numpy() - np.asarray(ref))))
    pairs = batch * k
    return {
        "pairs": pairs,
        "ours_pairs_per_s": pairs / t_ours,
        "pot_pairs_per_s": pairs / t_pot,
        "speedup": t_pot / t_ours,
        "max_abs_cost_diff": diff,
    }


def scaling_times(sizes=(250, 500, 1000, 2000, 4000), repeats: int = 3) -> dict[int, dict[str, list[float]]]:
    """CPU seconds of one epoch per size and variant (``clip``, ``otc``, ``otc_match``), ``repeats`` times, the
    variants of a size interleaved within each repeat; matching trainers first fill the bank with epoch 0."""
    dcfg = DefenseConfig(
        bank_size=2048, top_k=4, keep_margin=0.05, intra_subset=12, rematch_warmup=1, rematch_every=2
    )
    out = {}
    for n in sizes:
        bed = build_testbed(
            DataConfig(n_pairs=n, max_items=2, captions_per_target=10, backdoor_pairs=20, n_eval=10,
                       n_probe_train=10),
            seed=0,
        )  # fmt: skip
        tok = WordTokenizer.from_texts(bed.pairs.captions)
        tcfg = TrainConfig(epochs=4 + repeats, batch_size=50, warmup_steps=5)
        trainers = []
        for label, defense, epoch in (
            ("clip", "none", 0),
            ("otc", "otcclip", 0),
            ("otc_match", "otcclip", 1),
        ):
            torch.manual_seed(0)
            tr = Trainer(
                TinyCLIP(ModelConfig(patch_size=14), len(tok)), bed.pairs, tok, defense, tcfg, dcfg, seed=0
            )
            if epoch:
                tr.run_epoch(0)  # fill the bank as in a real run
            trainers.append((label, tr, epoch))
        out[n] = {label: [] for label, *_ in trainers}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for _ in range(repeats):
                for label, tr, epoch in trainers:
                    t = time.process_time()
                    tr.run_epoch(epoch)
                    out[n][label].append(time.process_time() - t)
    return out


def scaling_main(repeats: int = 3) -> None:
    """Print epoch time against n_pairs, the fitted per-pair costs and what they predict."""
    torch.set_num_threads(1)
    load_before = _load()
    times = scaling_times(repeats=repeats)
    load_after = _load()
    sizes = sorted(times)
    labels = ("clip", "otc", "otc_match")
    med = {lab: np.array([float(np.median(times[n][lab])) for n in sizes]) for lab in labels}
    # the recipe's epoch mix after warm-up: R = 2, half the epochs match
    med["otc_mean"] = (med["otc"] + med["otc_match"]) / 2
    print(f"epoch CPU time (s, median of {repeats}) against n_pairs, batch 50, one thread "
          f"({load_before} before, {load_after} after)")  # fmt: skip
    cols = (*labels, "otc_mean")
    print(f"{'n_pairs':>8s} " + " ".join(f"{c:>10s}" for c in cols) + f" {'ratio':>6s}")
    for i, n in enumerate(sizes):
        print(
            f"{n:8d} "
            + " ".join(f"{med[c][i]:10.3f}" for c in cols)
            + f" {med['otc_mean'][i] / med['clip'][i]:6.3f}"
        )
    x = np.array(sizes, dtype=float)
    fits = {}
    print("\nleast squares t = a + c n over all sizes; marginal c between the two largest sizes (bank full)")
    print(f"{'variant':>10s} {'a (s)':>8s} {'c (ms/pair)':>12s} {'max rel resid':>14s} {'marginal c':>11s} "
          f"{'1e5 pairs (s)':>14s} {'3.3e6 pairs (h)':>16s}")  # fmt: skip
    for c in cols:
        slope, icpt = np.polyfit(x, med[c], 1)
        resid = float(np.max(np.abs(icpt + slope * x - med[c]) / med[c]))
        marginal = float((med[c][-1] - med[c][-2]) / (x[-1] - x[-2]))
        fits[c] = {"a_s": round(float(icpt), 4), "c_ms_per_pair": round(1e3 * float(slope), 4),
                   "max_rel_residual": round(resid, 3), "marginal_ms_per_pair": round(1e3 * marginal, 4)}  # fmt: skip
        print(f"{c:>10s} {icpt:8.3f} {1e3 * slope:12.4f} {resid:14.3f} {1e3 * marginal:11.4f} "
              f"{med[c][-1] + marginal * (1e5 - x[-1]):14.1f} {(med[c][-1] + marginal * (3.3e6 - x[-1])) / 3600:16.2f}")  # fmt: skip
    print(
        json.dumps(
            {
                "scaling_sizes": sizes,
                "scaling_median_s": {c: [round(float(v), 4) for v in med[c]] for c in cols},
                "scaling_fit": fits,
                "scaling_load": [load_before, load_after],
            }
        )
    )


def _load() -> str:
    """The machine's 1-minute load average and core count, printed next to timings (shared machines)."""
    import os

    return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"


def main() -> None:
    torch.set_num_threads(1)
    load_before = _load()
    ep = epoch_times(repeats=7)
    ep_t = epoch_times(repeats=5, trained_epochs=3)
    load_after = _load()
    rm = rematch_throughput()
    conv = match_convergence()
    lconv = loss_convergence()
    print(f"epoch CPU time, 500 pairs, batch 50 ({load_before} before, {load_after} after)")
    print(
        "ratio = the variant's epoch / the plain-CLIP epoch of the same repeat: median [min - max] over repeats"
    )
    print(
        "ratio of mins = the variant's fastest epoch / the fastest plain-CLIP epoch (least disturbed by load)"
    )
    for title, times in (("fresh model", ep), ("after 3 trained epochs", ep_t)):
        print(f"{title:32s} {'median CPU s':>12s} {'ratio vs CLIP':>24s} {'ratio of mins':>14s}")
        for label, secs in times.items():
            med, lo, hi = ratio_stats(times, label)
            print(
                f"{label:32s} {float(np.median(secs)):12.3f} {med:10.3f} [{lo:.2f} - {hi:.2f}] "
                f"{min(secs) / min(times['clip']):14.3f}"
            )
        print()
    headline = {}
    for title, times in (("fresh", ep), ("trained", ep_t)):
        for name, labels in (
            ("", ("otc", "otc_match")),
            ("_nonmatching", ("otc",)),
            ("_matching", ("otc_match",)),
            ("_views_floor", ("otc_views_floor", "otc_match_views_floor")),
            ("_intra16", ("otc_intra16", "otc_match_intra16")),
            ("_before_round3", ("otc_prev3", "otc_match_prev3")),
            ("_nonmatching_before_round3", ("otc_prev3",)),
            ("_matching_before_round3", ("otc_match_prev3",)),
            ("_before_round2", ("otc_prev", "otc_match_prev")),
            ("_nonmatching_before_round2", ("otc_prev",)),
            ("_matching_before_round2", ("otc_match_prev",)),
        ):
            headline[f"{title}{name}"] = (
                *ratio_stats(times, *labels),
                float(np.mean([min(times[k]) for k in labels])) / min(times["clip"]),
            )
    # the headline overhead is averaged over the epoch types in proportion to the recipe (R = 2:
    # half the post-warm-up epochs match)
    print(
        "epoch overhead vs plain CLIP (mean of a non-matching and a matching epoch; target [ours] <= 1.15):"
    )
    print(f"  {'':36s} median [min - max] over repeats; ratio of mins")
    for key, (med, lo, hi, of_mins) in headline.items():
        print(f"  {key:36s} {med:.3f} [{lo:.2f} - {hi:.2f}]; {of_mins:.3f}")
    print()
    print("training-loss OT convergence: 64 intra-text problems (caption vs word-dropout view), fresh model")
    print(
        f"{'solve':10s} {'iters':>6s} {'max marg err':>13s} {'max cost err':>13s} {'loss err':>10s} {'ms':>8s}"
    )
    for r in lconv:
        print(
            f"{r['solve']:10s} {r['iters']:6d} {r['max_marginal_error']:13.2e} {r['max_cost_error']:13.2e} "
            f"{r['loss_error']:10.2e} {1e3 * r['seconds']:8.1f}"
        )
    print(
        f"\nre-ranking {rm['pairs']} (image, caption) OT problems, 16 patches x <=14 tokens, eps 0.05, 50 iters"
    )
    print(f"{'ours (batched)':32s} {rm['ours_pairs_per_s']:12.0f} pairs/s")
    print(f"{'POT sinkhorn_log per pair':32s} {rm['pot_pairs_per_s']:12.0f} pairs/s")
    print(f"speedup {rm['speedup']:.1f}x, max |cost diff| {rm['max_abs_cost_diff']:.2e}")
    print(f"\nre-matching OT convergence, {32 * 17} clustered problems (16 x <=14 points, 4 clusters)")
    print(
        f"{'eps':>5s} {'solve':10s} {'iters':>6s} {'max marg err':>13s} {'max cost err':>13s} {'conv':>6s} {'ms':>8s}"
    )
    for r in conv:
        print(
            f"{r['eps']:5.2f} {r['solve']:10s} {r['iters']:6d} {r['max_marginal_error']:13.2e} "
            f"{r['max_cost_error']:13.2e} {r['converged_share']:6.3f} {1e3 * r['seconds']:8.1f}"
        )
    tol_vs_fixed = {r["eps"]: r["seconds"] for r in conv if r["solve"] == "tol 1e-3"}
    fixed_t = {r["eps"]: r["seconds"] for r in conv if r["solve"] == "fixed 50"}
    lc = {r["solve"]: r for r in lconv}

    def med(times, *labels):
        return round(ratio_stats(times, *labels)[0], 3)

    def mean_ratio(times, num, den):  # median over repeats of sum(num) / sum(den)
        r = [sum(times[k][i] for k in num) / sum(times[k][i] for k in den) for i in range(len(times["clip"]))]
        return round(float(np.median(r)), 3)

    print(
        json.dumps(
            {
                "epoch_overhead_ratio": med(ep, "otc", "otc_match"),
                "epoch_overhead_ratio_spread": [round(v, 3) for v in headline["fresh"][1:3]],
                "epoch_overhead_ratio_of_mins": round(headline["fresh"][3], 3),
                "epoch_overhead_ratio_trained": med(ep_t, "otc", "otc_match"),
                "epoch_overhead_ratio_trained_spread": [round(v, 3) for v in headline["trained"][1:3]],
                "epoch_overhead_ratio_trained_of_mins": round(headline["trained"][3], 3),
                "epoch_overhead_ratio_nonmatching": med(ep, "otc"),
                "epoch_overhead_ratio_matching": med(ep, "otc_match"),
                "epoch_overhead_ratio_trained_nonmatching": med(ep_t, "otc"),
                "epoch_overhead_ratio_trained_matching": med(ep_t, "otc_match"),
                # the floor: second views and re-matching, (almost) no OT-loss solve
                "epoch_overhead_ratio_views_floor": med(ep, "otc_views_floor", "otc_match_views_floor"),
                # the recipe's intra_subset before the third switch set (16), its switches on
                "epoch_overhead_ratio_intra16": med(ep, "otc_intra16", "otc_match_intra16"),
                "epoch_overhead_ratio_trained_intra16": med(ep_t, "otc_intra16", "otc_match_intra16"),
                # before the third switch set (intra_subset 16, its three switches off)
                "epoch_overhead_ratio_before_round3": med(ep, "otc_prev3", "otc_match_prev3"),
                "epoch_overhead_ratio_trained_before_round3": med(ep_t, "otc_prev3", "otc_match_prev3"),
                # before the second switch set (its three switches off, and the third set's)
                "epoch_overhead_ratio_before_round2": med(ep, "otc_prev", "otc_match_prev"),
                "epoch_overhead_ratio_trained_before_round2": med(ep_t, "otc_prev", "otc_match_prev"),
                "epoch_overhead_ratio_topk16": med(ep, "otc", "otc_match_topk16"),
                # the first-round speed options off too (fused_ot_losses / reuse_own_text / fused_encoders)
                "epoch_overhead_ratio_unfused": med(ep, "otc_unfused", "otc_match_unfused"),
                "epoch_load": [load_before, load_after],
                # the training-loss OT solved to loss_tol vs the old fixed 50 iterations: epoch time ratio
                "loss_tol_vs_fixed50_epoch": mean_ratio(
                    ep, ("otc", "otc_match"), ("otc_fixed50loss", "otc_match_fixed50loss")
                ),
                "loss_tol_vs_fixed50_epoch_trained": mean_ratio(
                    ep_t, ("otc", "otc_match"), ("otc_fixed50loss", "otc_match_fixed50loss")
                ),
                "loss_ot_max_marginal_error": {k: r["max_marginal_error"] for k, r in lc.items()},
                "loss_ot_loss_error": {k: r["loss_error"] for k, r in lc.items()},
                "loss_ot_time_tol_vs_fixed50": round(
                    lc["tol 1e-2"]["seconds"] / lc["fixed 50"]["seconds"], 2
                ),
                "matching_epoch_tol_vs_fixed50": mean_ratio(ep, ("otc_match",), ("otc_match_fixed50",)),
                "match_ot_time_tol_vs_fixed50": {
                    str(e): round(tol_vs_fixed[e] / fixed_t[e], 2) for e in fixed_t
                },
                "match_ot_max_marginal_error": {
                    f"{r['solve']} eps {r['eps']}": r["max_marginal_error"] for r in conv
                },
                "match_ot_max_cost_error": {
                    f"{r['solve']} eps {r['eps']}": r["max_cost_error"] for r in conv
                },
                "rematch_speedup_vs_pot": round(rm["speedup"], 2),
                "rematch_pairs_per_s": round(rm["ours_pairs_per_s"], 1),
                "max_abs_cost_diff_vs_pot": rm["max_abs_cost_diff"],
            }
        )
    )


if __name__ == "__main__":
    import sys

    if "--scaling" in sys.argv[1:]:
        scaling_main()
    else:
        main()
