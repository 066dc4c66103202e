import pytest
import torch
import torch.nn.functional as F

from reprlab.methods.crl_safety import losses as L


def test_distances_known_answers():
    a, b = torch.tensor([[3.0, 0.0]]), torch.tensor([[0.0, 4.0]])
    assert L.distance(a, b, "l2").item() == pytest.approx(5.0)
    assert L.distance(a, b, "cosine").item() == pytest.approx(1.0)  # orthogonal
    assert L.distance(a, b, "sq_norm_l2").item() == pytest.approx(2.0)  # |e1 - e2|^2
    assert L.distance(a, b, "mix").item() == pytest.approx(5.0 + 10.0)
    assert L.distance(a, -a, "cosine").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="distance"):
        L.distance(a, b, "manhattan")


def test_crl_benign_loss_known_answer():
    # h' = h (positive distance 0); mu orthogonal (cos distance 1): ReLU(0 - 1 + m)
    h = torch.tensor([[[1.0, 0.0]]])  # [layers=1, n_tok=1, d=2]
    mu = torch.tensor([[[0.0, 1.0]]])
    assert L.crl_benign_loss(h, h, mu, "cosine", "cosine", 1.5).item() == pytest.approx(0.5)
    assert L.crl_benign_loss(h, h, mu, "cosine", "cosine", 0.3).item() == 0.0


def test_crl_harmful_loss_pulls_to_centroid_and_away_from_start():
    h_frozen = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    h_trained = torch.tensor([[[0.0, 1.0], [0.0, 1.0]]])  # moved orthogonal, collapsed
    mu = L.harmful_centroid(h_trained, detach=False)
    # d(h', mu) = 0, d(h', h) = 1: ReLU(0 - 1 + 0.5) = 0
    assert L.crl_harmful_loss(h_trained, h_frozen, mu, "cosine", 0.5).item() == 0.0
    # unchanged states: ReLU(0 - 0 + m) = m
    mu0 = L.harmful_centroid(h_frozen, detach=False)
    assert L.crl_harmful_loss(h_frozen, h_frozen, mu0, "cosine", 0.5).item() == pytest.approx(0.5)


def test_centroid_detach_flag_controls_gradient():
    h = torch.randn(2, 5, 3, requires_grad=True)
    assert L.harmful_centroid(h, detach=True).requires_grad is False
    assert L.harmful_centroid(h, detach=False).requires_grad is True


def test_kl_retain_matches_torch_kl_div():
    z, zp = torch.randn(7, 11), torch.randn(7, 11)
    t = 2.0
    ref = F.kl_div(
        F.log_softmax(zp / t, -1), F.log_softmax(z / t, -1), log_target=True, reduction="batchmean"
    )
    torch.testing.assert_close(L.kl_retain(z, zp, t), t**2 * ref)
    assert L.kl_retain(z, z, t).item() == pytest.approx(0.0, abs=1e-6)


def test_rr_losses_and_schedule():
    h = torch.randn(2, 4, 8)
    assert L.rr_retain_loss(h, h).item() == 0.0
    assert L.rr_reroute_loss(h, h).item() == pytest.approx(1.0)  # cos(h, h) = 1
    assert L.rr_reroute_loss(-h, h).item() == 0.0  # ReLU of -1
    assert L.rr_coefficients(0, 150, 10.0) == (0.0, 10.0)
    assert L.rr_coefficients(150, 150, 10.0) == pytest.approx((5.0, 5.0))  # t/(2N) = 1/2 at the end


def test_select_tokens_and_last_token_mask():
    hs = [torch.arange(2 * 3 * 1, dtype=torch.float).view(2, 3, 1) + 100 * i for i in range(3)]
    mask = torch.tensor([[False, True, True], [False, False, True]])
    out = L.select_tokens(hs, [0, 2], mask)
    assert out.shape == (2, 3, 1)
    assert out[1, :, 0].tolist() == [201.0, 202.0, 205.0]
    assert L.last_token_mask(mask).tolist() == [[False, False, True], [False, False, True]]


def test_kl_batchmean_is_the_codes_masked_kl_div():
    """The code multiplies logits by the mask (masked rows -> uniform on both sides -> 0) and calls kl_div with
    batchmean: a sum over tokens divided by the batch size. Oracle: that computation with torch's kl_div."""
    torch.manual_seed(0)
    z, zp = torch.randn(3, 5, 11), torch.randn(3, 5, 11)  # [batch, pos, d_vocab]
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    t = 2.0
    m = mask.unsqueeze(-1).float()
    ref = F.kl_div(F.log_softmax(zp * m / t, -1), F.softmax(z * m / t, -1), reduction="batchmean") * t**2
    got = L.kl_retain_batchmean(z, zp, mask, t)
    torch.testing.assert_close(got, ref)
    # against the per-token mean [ours]: sum over 12 masked tokens / 3 sequences = 4x the token mean here
    torch.testing.assert_close(got, L.kl_retain(z[mask], zp[mask], t) * mask.sum() / 3)


def test_rr_retain_scale_is_validated_when_the_config_loads():
    """A wrong ``defense.rr.retain_scale`` is a config error naming the choices, before any model loads."""
    import pytest

    from reprlab.config import ConfigError, load_config
    from reprlab.methods.crl_safety.recipe import Config

    assert load_config(Config, {}, ["defense.rr.retain_scale=relative"]).defense.rr.retain_scale == "relative"
    with pytest.raises(ConfigError, match=r"defense.rr.retain_scale.*'l2', 'relative'"):
        load_config(Config, {}, ["defense.rr.retain_scale=relatve"])
