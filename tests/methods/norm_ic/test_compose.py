"""Composition functions: known answers and invariants."""

import pytest
import torch

from reprlab.methods.norm_ic.compose import (
    ALL_COMPOSITIONS,
    ICDS_MODES,
    compose,
    compose_all,
    fit_context,
    icds_fold,
    icds_pair,
    reverse_valid,
)  # fmt: skip

TOL = dict(atol=1e-5, rtol=1e-5)  # float32 arithmetic over a handful of 8-d vectors


def _padded(seqs):
    """Left-aligned padded batch from a list of (k_i, d) tensors."""
    pos, d = max(len(s) for s in seqs), seqs[0].shape[1]
    x = torch.zeros(len(seqs), pos, d)
    mask = torch.zeros(len(seqs), pos, dtype=torch.bool)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
        mask[i, : len(s)] = True
    return x, mask


@pytest.mark.parametrize(
    "name", [c for c in ALL_COMPOSITIONS if c not in ("pooled", "scaled_c", "sif", "sif_pc")]
)
def test_single_subword_composes_to_itself(name):
    x = torch.randn(5, 1, 8)
    mask = torch.ones(5, 1, dtype=torch.bool)
    torch.testing.assert_close(compose(name, x, mask), x[:, 0], **TOL)


def test_sum_of_orthogonal_vectors_adds_squared_norms_and_ind_equals_sum():
    q, _ = torch.linalg.qr(torch.randn(8, 8))
    v = q[:3] * torch.tensor([[1.0], [2.0], [3.0]])  # 3 orthogonal vectors, norms 1, 2, 3
    x, mask = _padded([v])
    s = compose("sum", x, mask)
    assert float((s * s).sum()) == pytest.approx(1 + 4 + 9, rel=1e-5)
    torch.testing.assert_close(compose("ind", x, mask), s, **TOL)  # <x,y> = 0 makes IND = SUM


def test_icds_modes_match_closed_forms():
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    torch.testing.assert_close(icds_pair(x, y, 1.0, -2.0), x + y, **TOL)  # SUM
    torch.testing.assert_close(icds_pair(x, y, 0.25, -0.5), (x + y) / 2, **TOL)  # AVG
    nx, ny, dot = (x * x).sum(-1), (y * y).sum(-1), (x * y).sum(-1)
    joint = icds_pair(x, y, 1.0, 1.0)
    torch.testing.assert_close((joint * joint).sum(-1), (nx + ny - dot).clamp_min(0), **TOL)
    inf = icds_pair(x, y, 1.0, None)
    beta = torch.minimum(nx, ny) / torch.maximum(nx, ny)
    torch.testing.assert_close((inf * inf).sum(-1), (nx + ny - beta * dot).clamp_min(0), **TOL)
    # direction is (x + y)/|x + y| for every mode (gamma = 1)
    cos = torch.nn.functional.cosine_similarity(joint, x + y, dim=-1)
    torch.testing.assert_close(cos, torch.ones(6), **TOL)


@pytest.mark.parametrize("mode", ["joint", "inf"])
def test_joint_and_inf_are_idempotent(mode):
    x = torch.randn(4, 8)
    f = icds_pair(x, x, 1.0, 1.0 if mode == "joint" else None)
    torch.testing.assert_close(f, x, **TOL)  # |F(x,x)|^2 = 2|x|^2 - |x|^2, direction x


def test_avg_of_two_vectors_is_their_mean_and_sum_fold_is_sum():
    x, mask = _padded([torch.randn(2, 8), torch.randn(4, 8)])
    torch.testing.assert_close(compose("icds_avg", x[:1], mask[:1]), x[:1, :2].mean(1), **TOL)
    torch.testing.assert_close(compose("icds_sum", x, mask), compose("sum", x, mask), **TOL)


def test_scaled_readings_have_their_defining_norms():
    seqs = [torch.randn(k, 8) for k in (1, 3, 5)]
    x, mask = _padded(seqs)
    mu = torch.randn(8)
    for i, s in enumerate(seqs):
        n = len(s)
        a = compose("scaled_a", x, mask)[i]
        assert float(a @ a) == pytest.approx(float(s.sum(0) @ s.sum(0)) / n, rel=1e-4)
        b = compose("scaled_b", x, mask)[i]
        assert float(b @ b) == pytest.approx(float((s * s).sum()), rel=1e-4)  # IND over all items
        torch.testing.assert_close(compose("scaled_c", x, mask, mu=mu)[i], (s - mu).sum(0), **TOL)


def test_padding_does_not_change_any_composition():
    seqs = [torch.randn(k, 8) for k in (2, 5)]
    x, mask = _padded(seqs)
    p = torch.rand(2, 5) * 1e-3
    ctx = fit_context(x, mask, p)
    batched = compose_all(ALL_COMPOSITIONS[:-1], x, mask, ctx, p=p)
    for i, s in enumerate(seqs):
        single = compose_all(ALL_COMPOSITIONS[:-1], s[None], torch.ones(1, len(s), dtype=torch.bool), ctx,
                             p=p[i : i + 1, : len(s)])  # fmt: skip
        for name in single:
            torch.testing.assert_close(batched[name][i], single[name][0], **TOL, msg=name)


def test_right_to_left_fold_is_left_fold_of_reversed_items():
    x, mask = _padded([torch.randn(3, 8), torch.randn(5, 8)])
    rev = reverse_valid(x, mask)
    torch.testing.assert_close(rev[0, :3], x[0, :3].flip(0))
    torch.testing.assert_close(icds_fold(x, mask, "joint", "rtl"), icds_fold(rev, mask, "joint", "ltr"))
    assert not torch.allclose(icds_fold(x, mask, "joint", "rtl"), icds_fold(x, mask, "joint", "ltr"))


def test_sif_weights_and_pc_removal():
    x, mask = _padded([torch.randn(3, 8), torch.randn(2, 8)])
    p = torch.tensor([[1e-3, 1e-2, 1e-5], [1e-4, 1e-4, 1.0]])
    v = compose("sif", x, mask, p=p, sif_a=1e-3)
    w0 = 1e-3 / (1e-3 + p[0])
    torch.testing.assert_close(v[0], (x[0] * w0[:, None]).sum(0) / 3, **TOL)
    pc = torch.nn.functional.normalize(torch.randn(8), dim=0)
    v_pc = compose("sif_pc", x, mask, p=p, pc=pc)
    torch.testing.assert_close(v_pc @ pc, torch.zeros(2), atol=1e-5, rtol=0)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="no items"):
        compose("sum", x, torch.tensor([[True, False, False], [False, False, False]]))
    with pytest.raises(ValueError, match="unknown composition"):
        compose("median", x, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mu"):
        compose("scaled_c", x, torch.ones(2, 3, dtype=torch.bool))


def test_two_readings_of_icds_avg():
    """Ours (β = −½): ‖F‖² = ‖(x+y)/2‖². The ICDS code's compose_LM (β = +½): ‖F‖² = ‖(x−y)/2‖², same direction."""
    torch.manual_seed(3)
    x, y = torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64)
    ours, ref = icds_pair(x, y, *ICDS_MODES["icds_avg"]), icds_pair(x, y, *ICDS_MODES["icds_avg_ref"])
    assert ICDS_MODES["icds_avg"] == (0.25, -0.5) and ICDS_MODES["icds_avg_ref"] == (0.25, 0.5)
    torch.testing.assert_close((ours * ours).sum(-1), (((x + y) / 2) ** 2).sum(-1))
    torch.testing.assert_close((ref * ref).sum(-1), (((x - y) / 2) ** 2).sum(-1))
    unit = (x + y) / (x + y).norm(dim=-1, keepdim=True)
    torch.testing.assert_close(ref / ref.norm(dim=-1, keepdim=True), unit)
    assert icds_pair(x, x, *ICDS_MODES["icds_avg_ref"]).abs().max() < 1e-7  # F(x, x) = 0 under the reference
    seq, mask = _padded([torch.randn(3, 8)])  # folded over three items through compose()
    a, b, c = seq[0, :3].double()
    f = icds_pair(icds_pair(a[None], b[None], 0.25, 0.5), c[None], 0.25, 0.5)
    torch.testing.assert_close(compose("icds_avg_ref", seq.double(), mask), f)
