"""Re-matching (OTCCLIP OT re-ranking, RoCLIP nearest neighbour) and the caption bank."""

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import OTConfig
from reprlab.methods.otcclip.defenses.losses import ot_solve
from reprlab.methods.otcclip.defenses.matching import CaptionBank, nn_rematch, otc_rematch

E = torch.eye(4)
OT = OTConfig(eps=0.01, n_iters=200)


def _pool():
    """Candidate 0 ("B"): global cos 1 with the image but every token sits between the two patches;
    candidate 1 ("A"): slightly lower global cos, tokens equal to the patches (OT distance ~0)."""
    mid = F.normalize(E[0] + E[1], dim=0)
    tokens = torch.stack([torch.stack([mid, mid]), torch.stack([E[0], E[1]])])  # [P=2, m=2, d=4]
    glob = torch.stack([mid, F.normalize(E[0] + E[1] + 0.1 * E[2], dim=0)])
    return glob, tokens, torch.ones(2, 2, dtype=torch.bool)


def test_ot_reranking_prefers_the_caption_whose_tokens_match_the_patches():
    glob, tokens, mask = _pool()
    u = F.normalize(E[0] + E[1], dim=0)[None]
    patches = torch.stack([E[0], E[1]])[None]  # [1, n=2, d]
    cos = (u @ glob.T)[0]
    assert cos[0] > cos[1]  # the global-only rule (RoCLIP-like) picks candidate 0
    assert nn_rematch(u, glob).index.item() == 0
    assert otc_rematch(u, patches, glob, tokens, mask, top_k=2, alpha=1.0, ot=OT).index.item() == 0
    res = otc_rematch(u, patches, glob, tokens, mask, top_k=2, alpha=0.5, ot=OT)
    assert res.index.item() == 1  # OT distance 1 - cos(e1, mid) = 0.29 outweighs the cosine gap 0.005
    # known distances: ~0 for the matching tokens, 1 - 1/sqrt(2) for the midpoint tokens (entropic blur)
    assert abs(res.ot[0, 1].item()) < 0.01 and abs(res.ot[0, 0].item() - (1 - 2**-0.5)) < 0.01
    # the shortlist is applied before OT: with k = 1 only the top-cosine caption is considered
    assert otc_rematch(u, patches, glob, tokens, mask, top_k=1, alpha=0.5, ot=OT).index.item() == 0


def test_nn_rematch_equals_brute_force():
    torch.manual_seed(0)
    u, w = F.normalize(torch.randn(7, 5), dim=-1), F.normalize(torch.randn(11, 5), dim=-1)
    res = nn_rematch(u, w)
    brute = torch.tensor([max(range(11), key=lambda j: float(u[i] @ w[j])) for i in range(7)])
    # a best match: one matmul vs dot products round apart (~1e-7), so a near tie may go either way
    assert all(float(u[i] @ w[res.index[i]]) >= float(u[i] @ w[brute[i]]) - 1e-6 for i in range(7))


def test_caption_bank_is_fifo_and_pads():
    bank = CaptionBank(capacity=3, max_len=4, dim=2)
    for start in (0, 2):
        ids = torch.tensor([[start + 1, 0], [start + 2, 0]])
        bank.enqueue(
            ids,
            ids != 0,
            torch.ones(2, 2),
            torch.ones(2, 2, 2),
            torch.tensor([start + 1, start + 2]),
            torch.tensor([False, True]),
        )
    got = bank.entries()
    assert len(bank) == 3 and sorted(got["sig"].tolist()) == [2, 3, 4]  # oldest (1) overwritten
    assert got["ids"].shape == (3, 4) and (got["ids"][:, 1:] == 0).all() and (got["tokens"][:, 2:] == 0).all()
    assert got["poison"].sum() == 2


def test_own_caption_is_kept_unless_beaten_by_the_margin():
    glob, tokens, mask = _pool()
    u = F.normalize(E[0] + E[1], dim=0)[None]
    patches = torch.stack([E[0], E[1]])[None]
    own = torch.tensor([0])  # the image currently holds candidate 0; candidate 1 scores ~0.14 higher
    assert otc_rematch(u, patches, glob, tokens, mask, 2, 0.5, OT, own_index=own).index.item() == 1
    assert (
        otc_rematch(u, patches, glob, tokens, mask, 2, 0.5, OT, own_index=own, margin=0.5).index.item() == 0
    )
    # the own caption is a candidate even when the shortlist (k = 1 -> candidate 0 only) would miss it
    assert (
        otc_rematch(u, patches, glob, tokens, mask, 1, 0.5, OT, own_index=torch.tensor([1])).index.item() == 1
    )


def _clustered(batch=64, n=16, m=10, d=32, k=3, seed=0):
    """Patch/token sets drawn around a few shared directions (like trained features): slow Sinkhorn."""
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(k, d, generator=g), dim=-1)
    x = F.normalize(
        centres[torch.randint(0, k, (batch, n), generator=g)] + 0.05 * torch.randn(batch, n, d, generator=g),
        dim=-1,
    )
    y = F.normalize(
        centres[torch.randint(0, k, (batch, m), generator=g)] + 0.05 * torch.randn(batch, m, d, generator=g),
        dim=-1,
    )
    return x, y


def test_matching_ot_meets_its_tolerance_and_matches_pot_where_fixed_50_iterations_do_not():
    import ot as pot

    x, y = _clustered()
    cfg = OTConfig(eps=0.05, n_iters=50, match_tol=1e-3, match_max_iters=2000, loss_tol=None)
    res = ot_solve(x, y, None, None, cfg, matching=True)
    fixed = ot_solve(x, y, None, None, cfg, matching=False)  # the loss path with loss_tol null: 50 iterations
    assert bool(res.converged.all()) and float(res.marginal_error.max()) <= 1e-3
    # oracle: POT's log-domain Sinkhorn run to 1e-9, per problem, in float64
    ref = []
    for xi, yi in zip(x.double().numpy(), y.double().numpy()):
        cost = 1.0 - xi @ yi.T
        a, b = np.full(len(xi), 1 / len(xi)), np.full(len(yi), 1 / len(yi))
        plan = pot.sinkhorn(a, b, cost, reg=0.05, method="sinkhorn_log", numItermax=100_000, stopThr=1e-9)
        ref.append(float((plan * cost).sum()))
    ref = torch.tensor(ref)
    # L1 marginal error e moves <P, C> by at most ~e * max C = 2e-3 (cost in [0, 2]); measured ~1e-4
    assert float((res.cost.double() - ref).abs().max()) < 2e-3
    # the test has teeth: 50 fixed iterations are farther off than the tolerance allows on these features
    assert float(fixed.marginal_error.max()) > 1e-2 and float((fixed.cost.double() - ref).abs().max()) > 2e-3


def test_unconverged_matching_is_logged_and_warned_per_epoch(items):
    from .test_trainer import _trainer

    tr = _trainer(items, "otcclip")
    tr.dcfg = tr.impl.cfg = replace(
        tr.dcfg, ot=OTConfig(eps=0.01, n_iters=20, match_tol=1e-9, match_max_iters=10)
    )
    tr.run_epoch(0)
    with pytest.warns(RuntimeWarning, match="re-matching OT did not converge"):
        stats = tr.run_epoch(1)
    assert stats["phase"] == "otc_match" and stats["ot_max_marginal_error"] > 1e-9
    assert 0 <= stats["ot_converged_share"] < 1
    tr.dcfg = tr.impl.cfg = replace(tr.dcfg, ot=OTConfig(eps=0.1, match_tol=1e-3, match_max_iters=2000))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # converged: no warning
        stats = tr.run_epoch(2)
    assert stats["ot_converged_share"] == 1.0 and stats["ot_max_marginal_error"] <= 1e-3


def test_loss_ot_solves_to_its_tolerance_and_reports_it_where_fixed_50_iterations_do_not():
    """The training losses (``ot_alignment``) solve to ``loss_tol`` and hand their diagnostics back."""
    from reprlab.methods.otcclip.defenses.losses import ot_alignment, ot_alignments

    x, y = _clustered()
    cfg = OTConfig(eps=0.05, n_iters=50, loss_tol=1e-3, loss_max_iters=2000)
    diag: list = []
    loss = ot_alignment(x, y, None, None, cfg, diag)
    fixed_diag: list = []
    fixed = ot_alignment(x, y, None, None, replace(cfg, loss_tol=None), fixed_diag)
    (res,), (res_fixed,) = diag, fixed_diag
    assert float(res.marginal_error.max()) <= 1e-3 and bool(res.converged.all())
    assert res.n_iters > 50 and res_fixed.n_iters == 50
    assert float(res_fixed.marginal_error.max()) > 1e-2  # teeth: 50 iterations are not enough here
    ref = ot_solve(x, y, None, None, replace(cfg, loss_tol=1e-6, loss_max_iters=20_000)).cost.mean()
    assert abs(float(loss) - float(ref)) < 2e-3 < abs(float(fixed) - float(ref)) + 2e-3
    # the fused solve reports one result for all groups, within the same tolerance
    fused_diag: list = []
    ot_alignments([(x, y, None, None), (x[:8], x[:8], None, None)], cfg, fused_diag)
    assert len(fused_diag) == 1 and float(fused_diag[0].marginal_error.max()) <= 1e-3


def test_unconverged_loss_ot_is_logged_and_warned_per_epoch(items):
    from .test_trainer import _trainer

    tr = _trainer(items, "otcclip")
    tr.dcfg = tr.impl.cfg = replace(
        tr.dcfg, lambda_inter=0.1, lambda_intra=0.1, ot=OTConfig(eps=0.01, loss_tol=1e-9, loss_max_iters=10)
    )
    with pytest.warns(RuntimeWarning, match="training-loss OT did not converge"):
        stats = tr.run_epoch(0)
    assert stats["phase"] == "otc" and stats["loss_ot_marginal_error"] > 1e-9
    assert stats["loss_ot_iters"] == 10
    tr.dcfg = tr.impl.cfg = replace(tr.dcfg, ot=OTConfig(eps=0.1, loss_tol=1e-3, loss_max_iters=5000))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # converged: no warning
        stats = tr.run_epoch(0)
    assert stats["loss_ot_marginal_error"] <= 1e-3 and stats["loss_ot_iters"] < 5000
