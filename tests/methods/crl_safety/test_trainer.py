import pytest
import torch

from reprlab.methods.crl_safety.chat import collate, forward
from reprlab.methods.crl_safety.config import DefenseCfg, MiningCfg, OptimCfg, SftCfg
from reprlab.methods.crl_safety.mining import AffineLatentAttack, LatentAttacker, completion_ce
from reprlab.methods.crl_safety.trainer import Trainer, lora_blocks
from reprlab.models.lora import add_lora


def _pairs(fmt, texts, reply):
    return [(fmt.prompt_ids(t), fmt.response_ids(t, reply, end_turn=False)) for t in texts]


@pytest.fixture
def data(fmt):
    harm = _pairs(fmt, [f"do bad thing {i}" for i in range(6)], "Sure, step one")
    ben = _pairs(fmt, [f"nice question {i}" for i in range(6)], "Here is an answer")
    return harm, ben


def _cfg(steps=3, **kw):
    return DefenseCfg(optim=OptimCfg(steps=steps, batch_size=3, lr=1e-2, checkpoint_every=100),
                      crl=__import__("reprlab.methods.crl_safety.config", fromlist=["CrlCfg"]).CrlCfg(
                          layers_benign="1:3", layers_harmful="1:3"),
                      rr=__import__("reprlab.methods.crl_safety.config", fromlist=["RrCfg"]).RrCfg(layers="1,3", retain_layers="all"),
                      mining=MiningCfg(blocks="0:1", refresh_every=2, iterations=2, gate_loss=1e9, prob=1.0), **kw)  # fmt: skip


@pytest.mark.parametrize("kind", ["sft", "rr", "crl", "crl_adv"])
def test_each_kind_trains_only_adapters(tiny, data, kind):
    model, tok = tiny
    harm, ben = data
    base = {k: v.clone() for k, v in model.state_dict().items()}
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    cfg = SftCfg(optim=OptimCfg(steps=3, batch_size=3, lr=1e-2)) if kind == "sft" else _cfg()
    tr = Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id)
    out = tr.fit()
    assert out["steps"] == 3 and torch.isfinite(torch.tensor(out["loss"]))
    if kind == "crl_adv":
        assert tr.attacker.n_refresh >= 1 and out["adv"] in (0, 1)
    changed = [n for n, p in peft.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert changed  # B moved away from zero
    with peft.disable_adapter():  # frozen base weights untouched
        for k, v in peft.get_base_model().state_dict().items():
            if "lora" not in k and "base_layer" not in k and k in base:
                torch.testing.assert_close(v, base[k], rtol=0, atol=0)


def test_frozen_cache_equals_per_step_frozen_pass(tiny, data):
    """Caching frozen states per example (padded alone) equals computing them in the step's batch."""
    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    cached = Trainer("crl", peft, _cfg(), harm, ben, tok.pad_token_id)
    fresh = Trainer(
        "crl",
        peft,
        DefenseCfg(optim=OptimCfg(cache_frozen=False), crl=cached.cfg.crl),
        harm,
        ben,
        tok.pad_token_id,
    )
    idx = [4, 0, 2]
    b = cached._batch(ben, idx)
    s1, l1 = cached._frozen_rows("benign", ben, idx, b, logits=True)
    s2, l2 = fresh._frozen_rows("benign", ben, idx, b, logits=True)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)  # padding-layout float noise
    torch.testing.assert_close(l1, l2, atol=1e-4, rtol=1e-4)


def test_crl_step_zero_has_positive_margin_loss(tiny, data):
    """At step 0 h' = h, so L_h = ReLU(d(h, mu) - 0 + m_h) >= m_h (known lower bound)."""
    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    tr = Trainer("crl", peft, _cfg(), harm, ben, tok.pad_token_id)
    _, info = tr.loss(0)
    assert info["l_harmful"] >= 0.5 - 1e-6
    assert info["kl"] == pytest.approx(0.0, abs=1e-6)  # identical logits at init


def test_lora_blocks_auto_follows_targets():
    cfg = DefenseCfg()
    assert lora_blocks("auto", "crl", cfg, 30) == list(range(28))  # hidden layers up to 28 -> blocks 0..27
    assert lora_blocks("auto", "rr", cfg, 30) == list(range(20))  # CB: adapters up to the last reroute layer


def test_latent_attack_identity_at_init_and_learns(tiny, fmt, data):
    model, tok = tiny
    harm, _ = data
    b = collate(harm[:3], tok.pad_token_id)
    with torch.no_grad():
        clean = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=None).logits
        with AffineLatentAttack(32, block=1).attach(model):
            hooked = forward(model, b.attention_mask, input_ids=b.input_ids, logits_last=None).logits
    torch.testing.assert_close(hooked, clean, atol=1e-5, rtol=1e-5)  # W = I, b = 1e-7 at init
    att = LatentAttacker(32, [1], lr=1e-2)
    att.refresh(torch.Generator().manual_seed(0))
    before = float(completion_ce(model, b).detach())
    att.train(model, iter(lambda: b, None), iterations=20, stop_loss=0.0, window=5)
    assert att.losses[-1] < before  # minimising the harmful-completion CE
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("recorder_first", [False, True])
def test_the_attacked_blocks_hidden_state_is_the_attacked_output_whenever_the_recorder_was_installed(
    tiny, data, recorder_first
):
    """transformers installs its hidden-state recorder hooks at the first forward that asks for hidden states: the
    attack's hook must come before them either way (once it came after them on every forward but the first of a
    process, so a resumed CRL+mining run read other states than the uninterrupted one)."""
    model, tok = tiny
    harm, _ = data
    b = collate(harm[:3], tok.pad_token_id)
    attack = AffineLatentAttack(32, block=1)
    with torch.no_grad():
        attack.weight.mul_(2.0)  # h -> 2 h + b: a visible move
        if recorder_first:
            clean = forward(model, b.attention_mask, input_ids=b.input_ids).hidden_states
        with attack.attach(model):
            hs = forward(model, b.attention_mask, input_ids=b.input_ids).hidden_states
        if not recorder_first:
            clean = forward(model, b.attention_mask, input_ids=b.input_ids).hidden_states
    torch.testing.assert_close(hs[1], clean[1], rtol=0, atol=0)  # before the attacked block: untouched
    torch.testing.assert_close(hs[2], attack(clean[2]), rtol=0, atol=0)  # block 1's output, attacked
    assert not torch.equal(hs[3], clean[3])  # and the next block reads it


def test_state_means_is_the_balanced_mean_of_class_means(tiny, data):
    """Independent recomputation: one unpadded pass per example, then mean of the two class means."""
    from reprlab.methods.crl_safety.trainer import state_means

    model, tok = tiny
    harm, ben = data
    got = state_means(model, harm[:5], ben[:3], tok.pad_token_id, chunk=2)
    class_means = []
    for pairs in (harm[:5], ben[:3]):
        rows = []
        for p, r in pairs:
            ids = torch.tensor([p + r])
            with torch.no_grad():
                hs = model(input_ids=ids, output_hidden_states=True).hidden_states
            rows.append(torch.stack([h[0, len(p) :] for h in hs]))  # [layers, n_resp, d]
        class_means.append(torch.cat(rows, 1).mean(1))
    torch.testing.assert_close(got, (class_means[0] + class_means[1]) / 2, atol=1e-4, rtol=1e-4)


def test_centering_is_a_no_op_for_l2_losses_and_for_a_zero_centre(tiny, data):
    """L2 is translation-invariant, so centred and raw CRL losses agree; a zero centre equals no centring."""
    from reprlab.methods.crl_safety.config import CrlCfg

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    l2 = CrlCfg(layers_benign="1:3", layers_harmful="1:3", d_pos="l2", d_neg="l2", d_harm="l2",
                margin_benign=5.0, margin_harmful=5.0)  # fmt: skip
    cos = CrlCfg(layers_benign="1:3", layers_harmful="1:3")

    def loss(crl, center_states, center=None):
        tr = Trainer("crl", peft, DefenseCfg(optim=OptimCfg(batch_size=3), crl=crl, center_states=center_states),
                     harm, ben, tok.pad_token_id, seed=3, center=center)  # fmt: skip
        with torch.no_grad():
            return float(tr.loss(0)[0])

    assert loss(l2, True) == pytest.approx(loss(l2, False), rel=1e-5)
    zero = torch.zeros(5, 32)  # [n_layers + 1, d_model]
    assert loss(cos, True, zero) == pytest.approx(loss(cos, False), rel=1e-6)
    assert loss(cos, True) != pytest.approx(loss(cos, False), rel=1e-3)  # the real centre changes cosines


def test_rr_schedule_steps_overrides_the_run_length():
    from reprlab.methods.crl_safety import losses as L

    # CB's 150-step schedule at step 15 of a 20-step run: c_retain = 10 * 15 / 300
    assert L.rr_coefficients(15, 150, 10.0) == pytest.approx((0.5, 9.5))


def test_crl_adv_with_the_attack_never_used_trains_exactly_like_crl(tiny, data):
    """The mining draws its own batches, coin flips and dropout, so with prob = 0 CRL+mining = CRL bit for bit."""
    import dataclasses

    harm, ben = data
    out = {}
    for kind in ("crl", "crl_adv"):
        model, tok = tiny
        torch.manual_seed(0)
        peft = add_lora(model, r=4, alpha=8, dropout=0.1)
        cfg = _cfg(steps=3)
        cfg = dataclasses.replace(cfg, mining=dataclasses.replace(cfg.mining, prob=0.0))
        Trainer(kind, peft, cfg, harm, ben, tok.pad_token_id, seed=0).fit()
        out[kind] = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" in n}
        peft.unload()
    assert out["crl"].keys() == out["crl_adv"].keys()
    for n in out["crl"]:
        torch.testing.assert_close(out["crl"][n], out["crl_adv"][n], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["crl", "crl_adv"])
def test_interrupted_and_resumed_training_ends_where_an_uninterrupted_one_does(tiny, data, tmp_path, kind):
    """Checkpoints carry the adapters, optimizer, RNGs and (for mining) the live latent attack and its state."""
    import dataclasses

    from reprlab.runs import Run

    harm, ben = data

    class Interrupted(Exception):
        pass

    class Stopping(Trainer):  # dies at the start of step 3, after the step-2 checkpoint
        def loss(self, step):
            if step == 3:
                raise Interrupted
            return super().loss(step)

    def train(run_dir, cls=Trainer):
        model, tok = tiny
        torch.manual_seed(0)
        peft = add_lora(model, r=4, alpha=8, dropout=0.1)
        cfg = _cfg(steps=5)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, checkpoint_every=2),
                                  mining=dataclasses.replace(cfg.mining, refresh_every=5, prob=1.0))  # fmt: skip
        run = Run.create(run_dir, cfg, "crl-tiny", resume=run_dir.exists(), quiet=True)
        try:
            cls(kind, peft, cfg, harm, ben, tok.pad_token_id, run=run, seed=0).fit()
        except Interrupted:
            pass
        out = {n: p.detach().clone() for n, p in peft.named_parameters() if "lora_" in n}
        peft.unload()
        return out

    whole = train(tmp_path / "whole")
    train(tmp_path / "cut", Stopping)
    resumed = train(tmp_path / "cut")
    for n in whole:
        torch.testing.assert_close(resumed[n], whole[n], rtol=0, atol=0)


def test_residual_mining_init_is_the_codes_two_h_plus_b(tiny):
    """code AddedModule: h + linear(h), linear = I, b = 1e-7 -> 2h + 1e-7; ours ('identity') starts at h."""
    h = torch.randn(2, 3, 32)
    torch.testing.assert_close(AffineLatentAttack(32, 0, residual=True)(h), 2 * h + 1e-7)
    torch.testing.assert_close(AffineLatentAttack(32, 0)(h), h + 1e-7)
    att = LatentAttacker(32, [1], lr=1e-2, init="residual")
    att.refresh(torch.Generator().manual_seed(0))
    assert att.module.residual
    with pytest.raises(ValueError, match="mining.init"):
        LatentAttacker(32, [1], lr=1e-2, init="zero")


def test_retain_kl_is_batchmean_over_request_and_response_tokens(tiny, data):
    """kl_data='retain': the trainer's KL equals the code's kl_div(batchmean) over every non-pad token of a retain
    batch drawn by its own RNG, computed here from two independent full forwards (adapters off / on)."""
    import dataclasses
    import random

    import torch.nn.functional as F

    from reprlab.methods.crl_safety.config import CrlCfg

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # move the adapters so trained != frozen
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    crl = CrlCfg(layers_benign="1:3", layers_harmful="1:3", kl_reduction="batchmean", kl_data="retain")
    retain = ben[:4] + harm[:1]
    dcfg = dataclasses.replace(_cfg(), crl=crl)
    tr = Trainer("crl", peft, dcfg, harm, ben, tok.pad_token_id, seed=3, retain=retain)
    idx = random.Random(3 + 2).sample(range(len(retain)), 3)  # the retain RNG: seed + 2, batch_size 3
    got = tr._kl_retain_set()
    b = collate([retain[i] for i in idx], tok.pad_token_id)
    with torch.no_grad():
        with peft.disable_adapter():
            z = forward(peft, b.attention_mask, input_ids=b.input_ids, logits_last=None).logits
        zp = forward(peft, b.attention_mask, input_ids=b.input_ids, logits_last=None).logits
    m = b.attention_mask.unsqueeze(-1).float()
    ref = F.kl_div(F.log_softmax(zp * m / 2.0, -1), F.softmax(z * m / 2.0, -1), reduction="batchmean") * 4.0
    assert float(ref) > 1e-3  # the adapters moved the logits: a real comparison
    torch.testing.assert_close(got.detach(), ref, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="retain set"):
        Trainer("crl", peft, dcfg, harm, ben, tok.pad_token_id)


def test_rr_as_published_reroutes_and_retains_over_request_and_response(tiny, data):
    """CB's losses recomputed from two plain forwards: reroute = sum of ReLU(cos) over every non-pad token (request
    and response) at the target layers / token count; retain = mean L2 over every non-pad token of all layers."""
    import random

    import torch.nn.functional as F

    from reprlab.methods.crl_safety.config import RrCfg

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    cfg = _cfg(center_states=False)
    assert (cfg.rr.reroute_tokens, cfg.rr.retain_tokens, cfg.rr.retain_refusals) == (
        "all",
        "all",
        True,
    )  # CB defaults
    tr = Trainer("rr", peft, cfg, harm, ben, tok.pad_token_id, seed=5)
    rng = random.Random(5)
    ih, ib = rng.sample(range(len(harm)), 3), rng.sample(range(len(ben)), 3)
    _, info = tr.loss(0)

    def states(pairs, idx, adapters):
        b = collate([pairs[i] for i in idx], tok.pad_token_id)
        with torch.no_grad():
            if adapters:
                hs = forward(peft, b.attention_mask, input_ids=b.input_ids).hidden_states
            else:
                with peft.disable_adapter():
                    hs = forward(peft, b.attention_mask, input_ids=b.input_ids).hidden_states
        return torch.stack(hs), b.attention_mask.bool()  # [layers + 1, batch, pos, d], [batch, pos]

    (hp, m), (hf, _) = states(harm, ih, True), states(harm, ih, False)
    lay = [1, 3]
    cos = F.cosine_similarity(hp[lay], hf[lay], dim=-1)  # [2, batch, pos]
    reroute = (F.relu(cos) * m).sum() / (m.sum() * len(lay))
    assert m.sum() > sum(len(harm[i][1]) for i in ih)  # the mask covers the request too
    (bp, mb), (bf, _) = states(ben, ib, True), states(ben, ib, False)
    retain = ((bp - bf).norm(dim=-1) * mb).sum() / (mb.sum() * bp.shape[0])
    assert info["reroute"] == pytest.approx(float(reroute), rel=1e-4)  # float32 padding-layout noise
    assert info["retain"] == pytest.approx(float(retain), rel=1e-4)
    import dataclasses

    rr_old = RrCfg(layers="1,3", retain_layers="all", reroute_tokens="response", retain_tokens="response")
    old = Trainer("rr", peft, dataclasses.replace(cfg, rr=rr_old), harm, ben, tok.pad_token_id, seed=5)
    assert old.loss(0)[1]["reroute"] != pytest.approx(
        info["reroute"], rel=1e-3
    )  # the option changes the term


def test_rr_trains_its_own_step_count_with_cbs_schedule(tiny, data):
    """rr.steps = N (CB: 150) overrides optim.steps for RR only; the schedule is alpha t/(2N) over those N steps."""
    import dataclasses

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    cfg = _cfg(steps=5)
    cfg = dataclasses.replace(cfg, rr=dataclasses.replace(cfg.rr, steps=2))
    tr = Trainer("rr", peft, cfg, harm, ben, tok.pad_token_id)
    assert tr.fit()["steps"] == 2
    assert tr.loss(1)[1]["c_retain"] == pytest.approx(10.0 * 1 / (2 * 2))  # alpha 10, t = 1, N = 2
    assert Trainer("crl", peft, cfg, harm, ben, tok.pad_token_id).steps == 5  # CRL keeps optim.steps


def _rr_moves(retain_scale: str, retain_weight: float = 1.0) -> tuple[list[float], list[float]]:
    """Train RR 12 steps on a tiny random Llama (residual norms ~30-50 at the reroute layers) and return the
    centred cos(trained, frozen) of held-out harmful and benign response tokens at layers 1 and 3."""
    from reprlab.methods.crl_safety.chat import ChatFormat
    from reprlab.methods.crl_safety.config import RrCfg
    from reprlab.methods.crl_safety.metrics import mechanism
    from reprlab.models.hf import tiny_llama

    model, tok = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)
    fmt = ChatFormat(tok, None, max_prompt_tokens=40)
    harm = _pairs(fmt, [f"do bad thing {i}" for i in range(6)], "Sure, step one")
    ben = _pairs(fmt, [f"nice question {i}" for i in range(6)], "Here is an answer")
    torch.manual_seed(0)
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    cfg = DefenseCfg(optim=OptimCfg(steps=12, batch_size=3, lr=1e-2, checkpoint_every=100), center_states=True,
                     rr=RrCfg(layers="1,3", retain_layers="all", retain_scale=retain_scale,
                              retain_weight=retain_weight))  # fmt: skip
    Trainer("rr", peft, cfg, harm, ben, tok.pad_token_id, seed=0).fit()
    m = mechanism(peft, harm, ben, tok.pad_token_id, [1, 3], frozen_ctx=peft.disable_adapter())
    return m["cos_harmful_centered"], m["cos_benign_centered"]


def test_rr_with_crl_tiny_retain_scale_moves_the_harmful_representations():
    """crl-tiny's RR (retain_scale from the recipe) must reroute: harmful centred cos(trained, frozen) drops well
    below 1. Measured: 0.24 / 0.02 at layers 1 / 3 with 'relative'; with CB's 'l2' it stays >= 0.9998."""
    from pathlib import Path

    import yaml

    from reprlab.methods.crl_safety import recipe as R

    recipe = yaml.safe_load((Path(R.__file__).parent / "recipes" / "crl-tiny.yaml").read_text())
    scale = recipe["config"]["defense"]["rr"]["retain_scale"]
    harmful, _ = _rr_moves(scale)
    assert min(harmful) < 0.9, harmful


def test_rr_with_cbs_l2_retain_does_not_move_at_this_budget():
    """The measured reason for ``retain_scale``: with CB's raw L2 retain the retain gradient outweighs the reroute
    gradient (which scales as 1/||h||) and the same 12 steps leave the harmful states where they were."""
    harmful, _ = _rr_moves("l2")
    assert min(harmful) > 0.99, harmful


@pytest.mark.parametrize("retain_weight, selective", [(1.0, False), (3.0, True)])
def test_rr_retain_weight_keeps_benign_states_where_harmful_ones_move(retain_weight, selective):
    """``defense.rr.retain_weight`` on the tiny Llama (relative retain, 12 steps at lr 1e-2): at 3 the harmful states
    move (centred cos 0.945 / 0.80 at layers 1 / 3) while the benign ones stay (0.989 / 0.988); at 1 (crl-tiny's
    setting) the benign ones move too (0.50 / 0.32; harmful 0.24 / 0.02). On SmolLM2 no weight was selective at
    crl-tiny's budget (README table): this checks the option's effect, not a recommended value."""
    harmful, benign = _rr_moves("relative", retain_weight)
    assert min(harmful) < 0.9, harmful
    assert (min(benign) > 0.95) == selective, benign


def test_rr_retain_weight_scales_only_the_retain_term(tiny, data):
    import dataclasses

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    with torch.no_grad():  # move the states so both terms are non-trivial
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    out = {}
    for w in (1.0, 4.0):
        cfg = _cfg(steps=4)
        cfg = dataclasses.replace(
            cfg, rr=dataclasses.replace(cfg.rr, retain_scale="relative", retain_weight=w)
        )
        tr = Trainer("rr", peft, cfg, harm, ben, tok.pad_token_id, seed=0)
        torch.manual_seed(0)
        out[w] = tr.loss(2)
    (l1, t1), (l4, t4) = out[1.0], out[4.0]
    assert t1["retain"] == pytest.approx(t4["retain"]) and t1["reroute"] == pytest.approx(t4["reroute"])
    assert t1["retain"] > 0
    for w, loss in ((1.0, l1), (4.0, l4)):
        expect = w * t1["c_retain"] * t1["retain"] + t1["c_reroute"] * t1["reroute"]
        assert loss.item() == pytest.approx(expect, rel=1e-5)


def test_rr_relative_retain_is_l2_over_the_frozen_norm():
    from reprlab.errors import ConfigError
    from reprlab.methods.crl_safety import losses as L

    torch.manual_seed(0)
    h, f = torch.randn(2, 5, 8), 10 * torch.randn(2, 5, 8)
    torch.testing.assert_close(L.rr_retain_loss(h, f, "l2"), (h - f).norm(dim=-1).mean())
    torch.testing.assert_close(
        L.rr_retain_loss(h, f, "relative"), ((h - f).norm(dim=-1) / f.norm(dim=-1)).mean()
    )
    with pytest.raises(ConfigError, match="retain_scale"):
        L.rr_retain_loss(h, f, "l1")


def test_rr_reroute_gradient_vanishes_at_the_start_and_not_once_states_differ():
    """The measured start of RR: with LoRA's B = 0, h' = h and ReLU(cos(h', h)) sits at its maximum, so its gradient
    on the adapters is ~0 (float noise only); with B != 0 it is not. (rr_probe, tiny Llama.)"""
    from reprlab.methods.crl_safety.rr_probe import main

    at_start = main(["--model", "tiny-llama", "--steps", "1", "--grad-steps", "1"])[0]
    assert (
        at_start["reroute"] == pytest.approx(1.0, abs=1e-6) and at_start["grad_retain"] == 0.0
    )  # c_retain(0) = 0
    moved = main(["--model", "tiny-llama", "--steps", "1", "--grad-steps", "1", "--b-std", "0.05"])[0]
    assert at_start["grad_reroute"] < 1e-4 < moved["grad_reroute"], (at_start, moved)


def test_mining_both_trains_on_the_clean_and_the_attacked_harmful_states(tiny, data):
    """``mining.harmful_pass='both'`` [ours]: on an attacked step the harmful triplet runs over the clean and the
    attacked token states of one batch (the centroid over both, each frozen row paired twice), checked against the
    two passes computed here with the model's own ``output_hidden_states``; the code's 'attacked' uses only the
    attacked ones, and the two differ by far more than float noise under a real perturbation."""
    import dataclasses

    from reprlab.methods.crl_safety import losses as L

    model, tok = tiny
    harm, ben = data
    peft = add_lora(model, r=4, alpha=8, dropout=0.0)
    ih, ib = [0, 2, 4], [1, 3, 5]
    got = {}
    for mode in ("attacked", "both"):
        cfg = _cfg()
        cfg = dataclasses.replace(cfg, mining=dataclasses.replace(cfg.mining, harmful_pass=mode))
        tr = Trainer("crl_adv", peft, cfg, harm, ben, tok.pad_token_id, seed=0)
        tr._mining_step = lambda step: True  # an attacked step, with the fixed module below
        tr.attacker.refresh(torch.Generator().manual_seed(0))
        with torch.no_grad():  # a real perturbation: scale the block's output and shift it
            tr.attacker.module.weight.mul_(0.6)
            tr.attacker.module.bias.fill_(0.3)
        bh, bb = tr._batch(harm, ih), tr._batch(ben, ib)
        _, info = tr._loss_crl(1, bh, bb, ih, ib)
        got[mode] = info["l_harmful"]
    lh, mask = tr.layers["harmful"], tr._token_mask(bh)
    with torch.no_grad():
        clean = peft(input_ids=bh.input_ids, attention_mask=bh.attention_mask, output_hidden_states=True)
        with tr.attacker.module.attach(peft):
            att = peft(input_ids=bh.input_ids, attention_mask=bh.attention_mask, output_hidden_states=True)
    states = [torch.stack([o.hidden_states[i][mask] for i in lh]) for o in (clean, att)]
    f_harm, _ = tr._frozen_rows("harmful", harm, ih, bh, logits=False)
    h = tr._c(torch.cat(states, dim=1), lh)
    f = tr._c(torch.cat([f_harm, f_harm], dim=1), lh)
    mu = h.mean(dim=1, keepdim=True)
    want = L.crl_harmful_loss(h, f, mu, tr.cfg.crl.d_harm, tr.cfg.crl.margin_harmful).item()
    assert got["both"] == pytest.approx(want, rel=1e-4, abs=1e-5)  # two code paths of the same float sums
    assert abs(got["both"] - got["attacked"]) > 1e-3
    with pytest.raises(ValueError, match="harmful_pass"):
        bad = dataclasses.replace(_cfg(), mining=dataclasses.replace(_cfg().mining, harmful_pass="clean"))
        Trainer("crl_adv", peft, bad, harm, ben, tok.pad_token_id)
