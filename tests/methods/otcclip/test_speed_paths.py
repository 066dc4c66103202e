"""The OTCCLIP speed paths compute what the plain paths compute: the lazy pool gathers the rows a
concatenation would, trimming all-padding columns leaves re-matching unchanged, the fused OT loss solve
equals separate solves, and fused encoder calls / reused own-caption features change nothing but the
number of forward passes.
With both options off the trainer reproduces the old path (same losses, weights, assignments)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.config import OTConfig
from reprlab.methods.otcclip.defenses.losses import ot_alignment, ot_alignments, ot_solve
from reprlab.methods.otcclip.defenses.matching import PoolRows, otc_rematch

from .test_trainer import DCFG, _trainer

OT = OTConfig(n_iters=50, match_tol=None, loss_tol=None)  # fixed iterations: batch-independent results


def _sets(batch, n, m, seed, d=8):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(batch, n, d, generator=g), dim=-1)
    y = F.normalize(torch.randn(batch, m, d, generator=g), dim=-1)
    lengths = torch.randint(1, m + 1, (batch,), generator=g)
    return x, y, torch.arange(m)[None] < lengths[:, None]


def test_pool_rows_gather_what_padding_and_concatenation_give():
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(5, 3, 2, generator=g), torch.randn(7, 6, 2, generator=g)
    full = torch.cat([F.pad(first, (0, 0, 0, 3)), second])  # the old pool: pad the batch, concatenate
    rows = PoolRows(first, second)
    index = torch.tensor([0, 11, 4, 5, 4, 2, 6])
    assert len(rows) == 12 and torch.equal(rows[index], full[index])
    mask = PoolRows(torch.ones(5, 3, dtype=torch.bool), torch.zeros(7, 6, dtype=torch.bool))
    assert mask[index].sum(1).tolist() == [3, 0, 3, 0, 3, 3, 0]


def test_rematching_ignores_columns_that_are_padding_everywhere():
    """The same pool stored 4 or 20 columns wide: identical choice and distances (the extra columns are
    padding in every candidate and are trimmed away; a distance solved on the wide pool is the oracle)."""
    torch.manual_seed(0)
    x, y, mask = _sets(6, 5, 4, seed=1)
    u = F.normalize(torch.randn(3, 8), dim=-1)
    glob = F.normalize(torch.randn(6, 8), dim=-1)
    wide_y, wide_m = F.pad(y, (0, 0, 0, 16)), F.pad(mask, (0, 16))
    patches = x[:3]
    narrow = otc_rematch(u, patches, glob, y, mask, 3, 0.5, OT)
    wide = otc_rematch(u, patches, glob, wide_y, wide_m, 3, 0.5, OT)
    # exact: a choice whose best-to-second score gap (>= 0.26) dwarfs rounding
    assert torch.equal(narrow.index, wide.index)
    assert torch.allclose(narrow.ot, wide.ot, atol=1e-6)  # float rounding only
    # the trimmed solve is the full-width solve: every shortlisted pair against ot_solve on 20 columns
    top = (u @ glob.T).topk(3, dim=1).indices.reshape(-1)
    assert int(mask[top].sum(1).max()) == 4  # a full-length caption is shortlisted: trimming must keep it
    x_rep = patches.repeat_interleave(3, dim=0)
    ref = ot_solve(x_rep, wide_y[top], None, wide_m[top], OT, matching=True).cost.view(3, 3)
    assert torch.allclose(wide.ot, ref, atol=1e-6)


def test_fused_ot_losses_equal_separate_solves_in_value_and_gradient():
    groups = [_sets(7, 4, 5, seed=2), _sets(3, 4, 4, seed=3), _sets(3, 5, 5, seed=4)]
    groups = [(x.clone().requires_grad_(), y.clone().requires_grad_(), None, m) for x, y, m in groups]
    # group 1 has no masks on either side (as the intra image term)
    groups[1] = (groups[1][0], groups[1][1], None, None)
    fused = ot_alignments(groups, OT)
    sum(fused).backward()
    grads = [(x.grad.clone(), y.grad.clone()) for x, y, _, _ in groups]
    for x, y, _, _ in groups:
        x.grad = y.grad = None
    separate = [ot_alignment(x, y, xm, ym, OT) for x, y, xm, ym in groups]
    sum(separate).backward()
    for f, s in zip(fused, separate):
        assert f.item() == pytest.approx(s.item(), abs=1e-6)  # float rounding only
    for (gx, gy), (x, y, _, _) in zip(grads, groups):
        assert torch.allclose(gx, x.grad, atol=1e-6) and torch.allclose(gy, y.grad, atol=1e-6)
    assert all(float(v) > 0.05 for v in fused)  # random sets: far from 0, so the comparison bites


@pytest.mark.parametrize("epoch", [0, 1])  # a non-matching and a matching epoch
def test_speed_options_leave_the_step_unchanged_and_save_forward_passes(items, epoch):
    """One otcclip epoch with the speed options (fused_ot_losses, reuse_own_text, fused_encoders) on vs off:
    same losses, assignments, and weights (to float rounding; plain SGD, since Adam's g / sqrt(v) turns
    rounding noise in ~0 gradients into full-size steps), with fewer encoder calls per step."""
    results = {}
    for on in (True, False):
        tr = _trainer(items, "otcclip", epochs=2, sgd=True)
        # fixed loss-OT iterations (with a tolerance each problem also stops on its own, reprlab.ot.sinkhorn.
        # RETIRE_CONVERGED; fixed iterations keep this test independent of that rule)
        tr.dcfg = replace(DCFG, fused_ot_losses=on, reuse_own_text=on, fused_encoders=on, ot=OT)
        tr.impl.cfg = tr.dcfg
        if epoch == 1:
            tr.run_epoch(0)  # fill the bank
        calls = {"text": [], "image": []}
        for kind in calls:
            encode = getattr(tr.model, f"encode_{kind}")
            setattr(
                tr.model, f"encode_{kind}", lambda *a, c=calls[kind], f=encode: c.append(len(a[0])) or f(*a)
            )
        stats = tr.run_epoch(epoch)
        results[on] = (stats, [p.detach().clone() for p in tr.model.parameters()], calls)
    (s_on, w_on, c_on), (s_off, w_off, c_off) = results[True], results[False]
    for k in ("loss", "loss_clip", "loss_ot_inter", "loss_ot_intra"):
        assert s_on[k] == pytest.approx(s_off[k], abs=1e-5), k  # rounding, amplified a little by 4 steps
    if epoch == 1:
        assert s_on["rematch_poison_moved"] == s_off["rematch_poison_moved"]
        assert s_on["rematch_clean_kept"] == s_off["rematch_clean_kept"]
    assert max(float((a - b).abs().max()) for a, b in zip(w_on, w_off)) < 1e-5  # rounding only
    steps, batch, sub = 32 // 8, 8, 2  # intra_subset 4 of a global batch of 8: every 2nd row
    # the same rows are encoded, in fewer calls: images view1 + view2[sub] in one call
    assert sum(c_on["image"]) == sum(c_off["image"]) == steps * (batch + batch // sub)
    assert len(c_off["image"]) - len(c_on["image"]) == steps
    if epoch == 0:  # own captions (8 rows) + caption views (4 rows) in one call; own[sub] reused
        assert c_on["text"] == [batch + batch // sub] * steps
        assert len(c_off["text"]) == 3 * steps
    else:  # matching: own[sub] + views[sub] together, then only the other own captions without gradient
        assert c_on["text"] == [2 * (batch // sub), batch - batch // sub] * steps
        assert len(c_off["text"]) == 3 * steps


def test_pool_text_features_in_eval_mode_equal_the_training_mode_forward(items, monkeypatch):
    """The pool's no-grad caption features come from an eval-mode forward (torch's fused inference path) when
    the model has no mode-dependent layer: the same values up to rounding, training mode restored; a model
    with dropout keeps its training-mode forward."""
    from reprlab.methods.otcclip.defenses import matching

    tr = _trainer(items, "otcclip")
    ids, mask = tr.ids[:8], tr.mask[:8]
    mask[3, 2:] = False  # padding inside the batch
    assert tr.model.training and matching._mode_independent(tr.model)
    eval_calls = []
    monkeypatch.setattr(
        type(tr.model), "eval", lambda self, f=type(tr.model).eval: eval_calls.append(1) or f(self)
    )
    fast = matching.pool_text_features(tr.model, ids, mask)
    assert eval_calls == [1] and tr.model.training
    with torch.no_grad():
        ref = tr.model.encode_text(ids, mask)
    assert not fast.global_.requires_grad
    torch.testing.assert_close(fast.global_, ref.global_, atol=1e-6, rtol=0)
    torch.testing.assert_close(fast.tokens, ref.tokens, atol=1e-6, rtol=0)
    assert torch.equal(fast.mask, ref.mask)
    tr.model.text_blocks.layers[0].dropout1.p = 0.1  # a mode-dependent layer: no eval-mode forward
    assert not matching._mode_independent(tr.model)
    matching.pool_text_features(tr.model, ids, mask)
    assert eval_calls == [1]


@pytest.mark.parametrize("epoch", [0, 1])  # a non-matching and a matching epoch
def test_second_round_switches_leave_the_epoch_unchanged(items, monkeypatch, epoch):
    """The second set of speed switches (NumPy Sinkhorn blocks, eval-mode pool encode, one-node OT-loss
    backward) on vs off, with the defaults (loss OT to its tolerance, re-matching to match_tol): same losses,
    assignments and weights up to float rounding."""
    import importlib

    from reprlab.methods.otcclip.defenses import losses, matching

    sk = importlib.import_module("reprlab.ot.sinkhorn")  # the module (reprlab.ot.sinkhorn is also a function)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(sk, "NUMPY_SMALL", on)
        monkeypatch.setattr(matching, "POOL_EVAL_FORWARD", on)
        monkeypatch.setattr(losses, "GROUPED_COSINE_GRAD", on)
        tr = _trainer(items, "otcclip", epochs=2, sgd=True)
        if epoch == 1:
            tr.run_epoch(0)
        stats = tr.run_epoch(epoch)
        results[on] = (stats, [p.detach().clone() for p in tr.model.parameters()])
    (s_on, w_on), (s_off, w_off) = results[True], results[False]
    for k in ("loss", "loss_clip", "loss_ot_inter", "loss_ot_intra", "loss_ot_iters"):
        assert s_on[k] == pytest.approx(s_off[k], abs=1e-5), k
    if epoch == 1:
        assert s_on["rematch_poison_moved"] == s_off["rematch_poison_moved"]
        assert s_on["rematch_clean_kept"] == s_off["rematch_clean_kept"]
        assert s_on["ot_max_marginal_error"] == pytest.approx(s_off["ot_max_marginal_error"], abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(w_on, w_off)) < 1e-5


@pytest.mark.parametrize("tol", [None, 1e-2])
def test_grouped_cosine_gradient_equals_autograd_through_the_cost(monkeypatch, tol):
    """ot_alignments' one-node backward (GROUPED_COSINE_GRAD) vs autograd through the padded cosine cost:
    bitwise the same values and solve, gradients equal up to rounding; inputs not unit-norm, zero (padding)
    vectors, duplicated points (1 - cos rounds below 0 and is clamped) and a detached side included."""
    from reprlab.methods.otcclip.defenses import losses

    g = torch.Generator().manual_seed(5)
    x0, y0, m0 = _sets(6, 4, 5, seed=6)
    x1 = 3.0 * torch.randn(3, 5, 8, generator=g)  # not unit-norm
    y1 = torch.cat([x1[:, :3], torch.randn(3, 2, 8, generator=g)], 1)  # duplicated points: cos = 1
    x2, y2, m2 = _sets(3, 4, 3, seed=7)
    y2 = y2 * m2[:, :, None]  # zero vectors on padding
    cfg = OTConfig(loss_tol=tol, n_iters=60)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(losses, "GROUPED_COSINE_GRAD", on)
        leaves = [t.clone().requires_grad_() for t in (x0, y0, x1, y1, x2)]
        groups = [
            (leaves[0], leaves[1], None, m0),
            (leaves[2], leaves[3], None, None),
            (leaves[4], y2.clone(), None, m2),  # y detached, as matched pool captions
        ]
        diag = []
        vals = losses.ot_alignments(groups, cfg, diag)
        (vals[0] + 2.0 * vals[1] + 0.5 * vals[2]).backward()
        results[on] = (vals, [t.grad for t in leaves], diag[0])
    (v_on, g_on, d_on), (v_off, g_off, d_off) = results[True], results[False]
    # same costs, same solve: bitwise (the same ATen ops on the same tensors)
    assert [float(v) for v in v_on] == [float(v) for v in v_off]
    assert d_on.n_iters == d_off.n_iters and torch.equal(d_on.plan, d_off.plan)
    for a, b in zip(g_on, g_off):
        assert float(b.abs().max()) > 1e-3  # every leaf gets a real gradient, so the comparison bites
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_skipping_the_own_caption_duplicate_leaves_the_match_unchanged(monkeypatch, margin):
    """SKIP_OWN_DUPLICATE: an image whose own caption is also shortlisted solves that problem once, not twice.
    Same choice, scores, distances and per-candidate diagnostics as solving both copies (each problem stops
    on its own, so the batch composition does not move a solve); fewer problems reach the solver. With
    margin 0 a duplicate ties column 0 exactly, which only column 0 may win."""
    from reprlab.methods.otcclip.defenses import matching

    g = torch.Generator().manual_seed(3)
    n_img, pool, d = 12, 20, 8
    patches = F.normalize(torch.randn(n_img, 5, d, generator=g), dim=-1)
    u = F.normalize(patches.mean(1) + 0.3 * torch.randn(n_img, d, generator=g), dim=-1)
    glob = F.normalize(torch.randn(pool, d, generator=g), dim=-1)
    glob[: n_img // 2] = F.normalize(u[: n_img // 2] + 0.2 * torch.randn(n_img // 2, d, generator=g), dim=-1)
    tokens = F.normalize(torch.randn(pool, 6, d, generator=g), dim=-1)
    mask = torch.arange(6)[None] < torch.randint(2, 7, (pool,), generator=g)[:, None]
    own = torch.arange(n_img)
    cfg = OTConfig()  # the defaults: tolerance solve (per-problem stop)
    out = {}
    for skip in (True, False):
        monkeypatch.setattr(matching, "SKIP_OWN_DUPLICATE", skip)
        out[skip] = otc_rematch(u, patches, glob, tokens, mask, 4, 0.5, cfg, own_index=own, margin=margin)
    new, old = out[True], out[False]
    shortlisted = ((u @ glob.T).topk(4, dim=1).indices == own[:, None]).any(1)
    assert 0 < int(shortlisted.sum()) < n_img  # some own captions are shortlisted, some are not
    assert (
        len(new.ot_result.cost)
        == len(old.ot_result.cost) - int(shortlisted.sum())
        == n_img * 5 - int(shortlisted.sum())
    )
    assert torch.equal(new.index, old.index)  # exact: a choice, score gaps >= 0.018 against ~1e-7 rounding
    torch.testing.assert_close(new.score, old.score, atol=1e-6, rtol=0)
    torch.testing.assert_close(new.ot, old.ot, atol=1e-6, rtol=0)
    torch.testing.assert_close(new.marginal_error, old.marginal_error, atol=1e-6, rtol=0)
    # exact: a decision, errors >= 2.7% (relative) from the tolerance
    assert torch.equal(new.converged, old.converged)
