"""One trainer for stage-0 refusal SFT, circuit breakers (RR), CRL and CRL + adversarial mining.

The four share data sampling, the frozen reference (the same model with adapters disabled, computed once
per example when ``cache_frozen``), the optimiser, logging and checkpoints; they differ only in
:meth:`Trainer.loss`. Batches are per class: ``harmful`` pairs (harmful prompt -> refusal for SFT, ->
compliant reply for the defenses) and ``benign`` pairs (harmless prompt -> the base model's reply, plus
harmful prompt -> refusal for CRL when configured).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from reprlab.methods.crl_safety import losses as L
from reprlab.methods.crl_safety.chat import Batch, collate, forward, response_logits
from reprlab.methods.crl_safety.config import DefenseCfg, SftCfg
from reprlab.methods.crl_safety.layers import num_layers, parse_layers
from reprlab.methods.crl_safety.metrics import response_states
from reprlab.methods.crl_safety.mining import LatentAttacker
from reprlab.models.lora import AdapterParams

KINDS = ("sft", "rr", "crl", "crl_adv")
Pair = tuple[list[int], list[int]]


def target_layers(kind: str, cfg: DefenseCfg | SftCfg, n_layers: int) -> dict[str, list[int]]:
    """Hidden-state layers each term of ``kind`` reads (index 0 = embeddings)."""
    if kind == "sft":
        return {}
    if kind == "rr":
        return {
            "harmful": parse_layers(cfg.rr.layers, n_layers),
            "benign": parse_layers(cfg.rr.retain_layers, n_layers),
        }
    return {
        "harmful": parse_layers(cfg.crl.layers_harmful, n_layers),
        "benign": parse_layers(cfg.crl.layers_benign, n_layers),
    }


def lora_blocks(spec: str, kind: str, cfg, n_layers: int) -> list[int] | None:
    """Decoder blocks that get adapters. ``auto``: blocks 0..(highest target hidden layer - 1), as in the code
    (LoRA on layers 0..max target layer); all blocks for SFT."""
    if spec != "auto":
        return [b for b in parse_layers(spec, n_layers) if b < n_layers]
    layers = target_layers(kind, cfg, n_layers)
    top = max((max(v) for v in layers.values()), default=n_layers)
    # retain over "all" layers must not widen RR's adapters: CB trains layers up to its reroute layers only
    if kind == "rr":
        top = max(layers["harmful"])
    return list(range(max(top, 1)))


def state_means(model, harmful: list[Pair], benign: list[Pair], pad_id: int, chunk: int = 8) -> Tensor:
    """Centre for cosine distances: per hidden layer, the mean of the harmful and the benign class means of
    response-token states ``[n_layers + 1, d_model]`` (balanced, so class sizes do not tilt it).

    Why: SmolLM2's residual stream carries a few high-norm directions shared by every token (about 80 % of
    the norm in the middle layers), so raw cos(h', h) stays near 1 however the adapters move the states.
    """
    layers = list(range(num_layers(model) + 1))
    h, _ = response_states(model, harmful, pad_id, layers, chunk)
    b, _ = response_states(model, benign, pad_id, layers, chunk)
    return (h.mean(1) + b.mean(1)) / 2


@dataclass
class FrozenRows:
    """Per-example frozen states ``[layers, n_tok, d_model]`` and response logits ``[n_resp, d_vocab]``."""

    states: list[Tensor]
    logits: list[Tensor] | None


class Trainer:
    """Train the adapters of ``model`` (a ``peft.PeftModel``) with one of :data:`KINDS`.

    Args:
        harmful, benign: ``(prompt_ids, response_ids)`` pairs.
        run: the ``reprlab.runs.Run`` (metrics, checkpoints under tag ``kind``).
        step_offset: added to local steps in metrics.jsonl/checkpoints so stages never share step numbers.
        center: precomputed :func:`state_means` of the frozen model (shared by defenses on one stage 0);
            computed here when ``cfg.center_states`` and not given.
        retain: the retain set of CRL's KL when ``crl.kl_data='retain'`` (the code's UltraChat; here harmless
            prompt -> base reply pairs), sampled with its own RNG.
    """

    def __init__(self, kind: str, model, cfg: DefenseCfg | SftCfg, harmful: list[Pair], benign: list[Pair],
                 pad_id: int, run=None, step_offset: int = 0, seed: int = 0, center: Tensor | None = None,
                 retain: list[Pair] | None = None):  # fmt: skip
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not harmful or not benign:
            raise ValueError(
                f"{kind}: empty training set ({len(harmful)} harmful, {len(benign)} benign pairs)"
            )
        self.kind, self.model, self.cfg, self.run = kind, model, cfg, run
        self.harmful, self.benign, self.pad_id, self.offset = harmful, benign, pad_id, step_offset
        # RR may train its own number of steps (CB: 150); the others train optim.steps
        self.steps = (cfg.rr.steps or cfg.optim.steps) if kind == "rr" else cfg.optim.steps
        self.n_layers = num_layers(model)
        self.layers = target_layers(kind, cfg, self.n_layers)
        self.device = next(model.parameters()).device
        self.rng = random.Random(seed)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.optim.lr, weight_decay=0.0)
        self.retain, self.retain_rng = None, None
        if kind in ("crl", "crl_adv"):
            c = cfg.crl
            if c.kl_reduction not in ("token_mean", "batchmean"):
                raise ValueError(
                    f"crl.kl_reduction must be 'token_mean' or 'batchmean', got {c.kl_reduction!r}"
                )
            if c.kl_data not in ("benign", "retain"):
                raise ValueError(f"crl.kl_data must be 'benign' or 'retain', got {c.kl_data!r}")
            if c.kl_data == "retain":
                if not retain:
                    raise ValueError(f"{kind}: crl.kl_data='retain' needs a non-empty retain set")
                self.retain, self.retain_rng = retain, random.Random(seed + 2)
        self.attacker = None
        if kind == "crl_adv":
            m = cfg.mining
            blocks = [b for b in parse_layers(m.blocks, self.n_layers) if b < self.n_layers]
            d_model = model.get_input_embeddings().weight.shape[1]
            self.attacker = LatentAttacker(d_model, blocks, m.lr, self.device, init=m.init)
            self._gen = torch.Generator().manual_seed(seed)
            # the attack draws its own batches and coin flips, so CRL and CRL+mining see the same training batches
            self.adv_rng = random.Random(seed + 1)
        self._frozen: dict[str, FrozenRows] = {}
        self.center = None
        if kind != "sft" and cfg.center_states:
            if center is None:
                with model.disable_adapter():
                    center = state_means(model, harmful, benign, pad_id)
            self.center = center.to(self.device)

    def _c(self, x: Tensor, layers: list[int]) -> Tensor:
        """Centre ``x [len(layers), n, d_model]`` with the frozen means (no-op when centring is off)."""
        return x if self.center is None else x - self.center[layers].unsqueeze(1).to(x.dtype)

    # ------------------------------------------------------------------ data
    def _batch(self, pairs: list[Pair], idx: list[int]) -> Batch:
        return collate([pairs[i] for i in idx], self.pad_id).to(self.device)

    def _sample(self, pairs: list[Pair], rng: random.Random | None = None) -> list[int]:
        n = min(self.cfg.optim.batch_size, len(pairs))
        return (rng or self.rng).sample(range(len(pairs)), n)

    def _token_mask(self, batch: Batch, which: str = "harmful") -> Tensor:
        """Tokens whose states a term reads: response tokens, CRL's 'last', or RR's request + response ('all')."""
        if self.kind in ("crl", "crl_adv") and self.cfg.crl.tokens == "last":
            return L.last_token_mask(batch.response_mask)
        if self.kind == "rr":
            rr = self.cfg.rr
            spec = rr.reroute_tokens if which == "harmful" else rr.retain_tokens
            if spec not in ("all", "response"):
                raise ValueError(f"rr token spec must be 'all' or 'response', got {spec!r}")
            if spec == "all":
                return batch.attention_mask.bool()
        return batch.response_mask

    @torch.no_grad()
    def _frozen_pass(self, batch: Batch, layers: list[int], logits: bool,
                     which: str = "harmful") -> tuple[list[Tensor], list[Tensor] | None]:  # fmt: skip
        """Frozen (adapters disabled) states/logits split per row of ``batch``."""
        with self.model.disable_adapter():
            out = forward(self.model, batch.attention_mask, input_ids=batch.input_ids, hidden=bool(layers),
                          logits_last=batch.n_response + 1 if logits else 1)  # fmt: skip
        mask = self._token_mask(batch, which)
        states = [torch.stack([out.hidden_states[i][r][mask[r]] for i in layers]) if layers else torch.empty(0)
                  for r in range(mask.shape[0])]  # fmt: skip
        rows = None
        if logits:
            lg, _, m = response_logits(out.logits, batch)
            rows = [lg[r][m[r]] for r in range(m.shape[0])]
        return states, rows

    def _frozen_rows(self, which: str, pairs: list[Pair], idx: list[int], batch: Batch, logits: bool):
        layers = self.layers.get(which, [])
        if not self.cfg.optim.cache_frozen:
            states, rows = self._frozen_pass(batch, layers, logits, which)
            return torch.cat(states, dim=1) if layers else None, torch.cat(rows) if logits else None
        if which not in self._frozen:
            cache = FrozenRows([], [] if logits else None)
            for s in range(0, len(pairs), 8):
                chunk = list(range(s, min(s + 8, len(pairs))))
                st, rw = self._frozen_pass(self._batch(pairs, chunk), layers, logits, which)
                cache.states += st
                if logits:
                    cache.logits += rw
            self._frozen[which] = cache
        c = self._frozen[which]
        states = torch.cat([c.states[i] for i in idx], dim=1) if layers else None
        return states, torch.cat([c.logits[i] for i in idx]) if logits else None

    # ------------------------------------------------------------------ losses
    def loss(self, step: int) -> tuple[Tensor, dict[str, float]]:
        """Loss of one step on freshly sampled harmful and benign batches."""
        ih, ib = self._sample(self.harmful), self._sample(self.benign)
        bh, bb = self._batch(self.harmful, ih), self._batch(self.benign, ib)
        if self.kind == "sft":
            return self._loss_sft(bh, bb, ib)
        if self.kind == "rr":
            return self._loss_rr(step, bh, bb, ih, ib)
        return self._loss_crl(step, bh, bb, ih, ib)

    def _loss_sft(self, bh: Batch, bb: Batch, ib: list[int]):
        c = self.cfg
        oh = forward(
            self.model, bh.attention_mask, input_ids=bh.input_ids, hidden=False, logits_last=bh.n_response + 1
        )
        lg, tg, m = response_logits(oh.logits, bh)
        ce_h = F.cross_entropy(lg[m].float(), tg[m])
        ob = forward(
            self.model, bb.attention_mask, input_ids=bb.input_ids, hidden=False, logits_last=bb.n_response + 1
        )
        lg, tg, m = response_logits(ob.logits, bb)
        ce_b = F.cross_entropy(lg[m].float(), tg[m])
        _, frozen = self._frozen_rows("benign", self.benign, ib, bb, logits=True)
        kl = L.kl_retain(frozen, lg[m], c.temperature)
        loss = ce_h + c.benign_ce_weight * ce_b + c.kl_weight * kl
        return loss, {"ce_refusal": ce_h.item(), "ce_benign": ce_b.item(), "kl": kl.item()}

    def _loss_rr(self, step: int, bh: Batch, bb: Batch, ih: list[int], ib: list[int]):
        c = self.cfg.rr
        c_retain, c_reroute = L.rr_coefficients(step, c.schedule_steps or self.steps, c.alpha)
        oh = forward(self.model, bh.attention_mask, input_ids=bh.input_ids, logits_last=1)
        lh = self.layers["harmful"]
        h_harm = L.select_tokens(oh.hidden_states, lh, self._token_mask(bh, "harmful"))
        f_harm, _ = self._frozen_rows("harmful", self.harmful, ih, bh, logits=False)
        reroute = L.rr_reroute_loss(self._c(h_harm, lh), self._c(f_harm, lh))
        ob = forward(self.model, bb.attention_mask, input_ids=bb.input_ids, logits_last=1)
        h_ben = L.select_tokens(ob.hidden_states, self.layers["benign"], self._token_mask(bb, "benign"))
        f_ben, _ = self._frozen_rows("benign", self.benign, ib, bb, logits=False)
        retain = L.rr_retain_loss(h_ben, f_ben)
        loss = c_retain * retain + c_reroute * reroute
        return loss, {
            "retain": retain.item(),
            "reroute": reroute.item(),
            "c_retain": c_retain,
            "c_reroute": c_reroute,
        }

    def _mining_step(self, step: int) -> bool:
        """Refresh/extend the latent attack; return whether this step's harmful pass goes through it."""
        m, a = self.cfg.mining, self.attacker
        batches = iter(lambda: self._batch(self.harmful, self._sample(self.harmful, self.adv_rng)), None)
        # fork torch's RNG: the attack's dropout draws must not shift the defence's own dropout masks
        with torch.random.fork_rng(devices=[]):
            if a.module is None or step % m.refresh_every == 0:
                a.refresh(self._gen)
                a.train(self.model, batches, m.iterations, m.stop_loss, m.window)
            elif m.extra_iters:
                a.train(self.model, batches, m.extra_iters, m.stop_loss, m.window)
        return a.ready(m.gate_loss) and self.adv_rng.random() < m.prob

    def _loss_crl(self, step: int, bh: Batch, bb: Batch, ih: list[int], ib: list[int]):
        c = self.cfg.crl
        adv = self._mining_step(step) if self.attacker is not None else False
        lh, lb = self.layers["harmful"], self.layers["benign"]
        union = sorted(set(lh) | set(lb))
        mh, mb = self._token_mask(bh), self._token_mask(bb)
        if adv:
            with self.attacker.module.attach(self.model):
                oh = forward(self.model, bh.attention_mask, input_ids=bh.input_ids, logits_last=1)
        else:
            oh = forward(self.model, bh.attention_mask, input_ids=bh.input_ids, logits_last=1)
        h_harm = self._c(L.select_tokens(oh.hidden_states, union, mh), union)  # [union, n_tok, d_model]
        mu = L.harmful_centroid(h_harm, c.detach_centroid)  # [union, 1, d_model]
        pick = lambda layers: [union.index(i) for i in layers]  # noqa: E731
        ob = forward(self.model, bb.attention_mask, input_ids=bb.input_ids, logits_last=bb.n_response + 1)
        h_ben = self._c(L.select_tokens(ob.hidden_states, lb, mb), lb)
        f_harm, _ = self._frozen_rows("harmful", self.harmful, ih, bh, logits=False)
        f_ben, f_logits = self._frozen_rows("benign", self.benign, ib, bb, logits=True)
        f_harm, f_ben = self._c(f_harm, lh), self._c(f_ben, lb)
        l_b = L.crl_benign_loss(h_ben, f_ben, mu[pick(lb)], c.d_pos, c.d_neg, c.margin_benign)
        l_h = L.crl_harmful_loss(h_harm[pick(lh)], f_harm, mu[pick(lh)], c.d_harm, c.margin_harmful)
        if c.kl_data == "retain":
            kl = self._kl_retain_set()
        else:
            lg, _, m = response_logits(ob.logits, bb)
            kl = L.kl_retain(f_logits, lg[m], c.temperature)
            if c.kl_reduction == "batchmean":  # token mean -> sum per sequence, mean over sequences
                kl = kl * m.sum() / m.shape[0]
        loss = c.alpha * l_b + c.beta * l_h + c.kl_weight * kl
        info = {"l_benign": l_b.item(), "l_harmful": l_h.item(), "kl": kl.item(), "adv": int(adv)}
        if self.attacker is not None and self.attacker.losses:
            info["attack_loss"] = self.attacker.losses[-1]
        return loss, info

    def _kl_retain_set(self) -> Tensor:
        """KL on a fresh retain batch over every non-pad token (request and response), as the code does."""
        c = self.cfg.crl
        br = self._batch(self.retain, self._sample(self.retain, self.retain_rng))
        with torch.no_grad(), self.model.disable_adapter():
            frozen = forward(
                self.model, br.attention_mask, input_ids=br.input_ids, hidden=False, logits_last=None
            ).logits
        trained = forward(
            self.model, br.attention_mask, input_ids=br.input_ids, hidden=False, logits_last=None
        ).logits
        mask = br.attention_mask.bool()
        if c.kl_reduction == "batchmean":
            return L.kl_retain_batchmean(frozen, trained, mask, c.temperature)
        return L.kl_retain(frozen[mask], trained[mask], c.temperature)

    def _ckpt_parts(self) -> tuple[dict, dict, dict]:
        """Modules, optimizers and JSON extras of a checkpoint; CRL+mining adds the live latent attack."""
        modules, optims = {"lora": AdapterParams(self.model)}, {"opt": self.opt}
        extra = {"rng": self.rng.getstate()}
        if self.retain_rng is not None:
            extra["retain_rng"] = self.retain_rng.getstate()
        a = self.attacker
        if a is not None and a.module is not None:
            modules["attack"], optims["attack_opt"] = a.module, a._opt
            extra["adv_rng"] = self.adv_rng.getstate()
            extra["attack"] = {"block": a.module.block, "losses": a.losses, "n_refresh": a.n_refresh,
                               "gen": self._gen.get_state().tolist()}  # fmt: skip
        return modules, optims, extra

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train ``self.steps`` steps, resuming from the latest checkpoint of tag ``kind``."""
        o = self.cfg.optim
        start = 0
        if self.run is not None and self.run.checkpoints(self.kind):
            if self.attacker is not None:  # a placeholder module to load the saved attack into
                self.attacker.refresh(torch.Generator())
            modules, optims, _ = self._ckpt_parts()
            step, extra = self.run.load_checkpoint(modules, optims, tag=self.kind)
            start = step - self.offset
            self.rng.setstate(_tuple_state(extra["rng"]))
            if self.retain_rng is not None and "retain_rng" in extra:
                self.retain_rng.setstate(_tuple_state(extra["retain_rng"]))
            if self.attacker is not None:
                a, st = self.attacker, extra["attack"]
                self.adv_rng.setstate(_tuple_state(extra["adv_rng"]))
                a.module.block, a.losses, a.n_refresh = st["block"], list(st["losses"]), st["n_refresh"]
                self._gen.set_state(torch.tensor(st["gen"], dtype=torch.uint8))
        self.model.train()
        t0, hist = time.time(), []
        for step in range(start, self.steps):
            t_step = time.time()
            self.opt.zero_grad(set_to_none=True)
            loss, info = self.loss(step)
            loss.backward()
            self.opt.step()
            hist.append({"loss": loss.item(), **info, "step_seconds": time.time() - t_step})
            if self.run is not None and (step % o.log_every == 0 or step == self.steps - 1):
                self.run.log(self.offset + step, **{f"{self.kind}.{k}": v for k, v in hist[-1].items()})
            done = step + 1
            if self.run is not None and (done % o.checkpoint_every == 0 or done == self.steps):
                modules, optims, extra = self._ckpt_parts()
                self.run.save_checkpoint(self.offset + done, modules, optims, extra=extra, tag=self.kind)
        self.model.eval()
        tail = hist[-5:]
        out = {k: sum(h[k] for h in tail) / len(tail) for k in (tail[0] if tail else {})}
        out.update(steps=self.steps, resumed_from=start, seconds=time.time() - t0)
        return out


def _tuple_state(state):
    """``random.Random.getstate`` after a JSON round trip (lists) back to tuples."""
    return (state[0], tuple(state[1]), state[2])
