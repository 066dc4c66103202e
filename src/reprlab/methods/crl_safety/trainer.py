"""One trainer for stage-0 refusal SFT, circuit breakers (RR), CRL and CRL + adversarial mining.

The four share data sampling, the frozen reference (the same model with adapters disabled, computed once
per example when ``cache_frozen``), the optimiser, logging and checkpoints; they differ only in
:meth:`Trainer.loss`. Batches are per class: ``harmful`` pairs (harmful prompt -> refusal for SFT, ->
compliant reply for the defenses) and ``benign`` pairs (harmless prompt -> the base model's reply, plus
harmful prompt -> refusal for CRL when configured).

Under ``torchrun`` (a process group initialised, the model sharded with :func:`scale.shard_model`, PyTorch FSDP2)
every rank samples the same global batch and runs the model on its contiguous share of rows. Terms that couple
rows (the harmful centroid, means over all tokens of the batch) read states gathered across ranks with
gradient (``reprlab.train.dist.all_gather_with_grad``); per-row sums (CE, KL) stay local and are summed across
ranks. Either way a rank's loss has the global value and its gradient is ``world`` times its rows' share, so
FSDP's gradient average gives the single-process gradient of the global batch (tested on 2 gloo ranks). Whole
replicas (no sharding) average their gradients the same way through PyTorch's DDP.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

from reprlab.methods.crl_safety import losses as L
from reprlab.methods.crl_safety.chat import Batch, collate, forward, response_logits
from reprlab.methods.crl_safety.config import MINING_HARMFUL_PASSES, DefenseCfg, SftCfg
from reprlab.methods.crl_safety.frozen import FrozenStore
from reprlab.methods.crl_safety.layers import num_layers, parse_layers
from reprlab.methods.crl_safety.metrics import response_states
from reprlab.methods.crl_safety.mining import LatentAttacker
from reprlab.models.lora import AdapterParams
from reprlab.train.dist import all_gather_nograd, all_gather_with_grad, shard, wrap_ddp
from reprlab.train.timing import section

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


def state_means(model, harmful: list[Pair], benign: list[Pair], pad_id: int, chunk: int = 8,
                store: FrozenStore | None = None) -> Tensor:  # fmt: skip
    """Centre for cosine distances: per hidden layer, the mean of the harmful and the benign class means of
    response-token states ``[n_layers + 1, d_model]`` (balanced, so class sizes do not tilt it).

    Why: SmolLM2's residual stream carries a few high-norm directions shared by every token (about 80 % of
    the norm in the middle layers), so raw cos(h', h) stays near 1 however the adapters move the states.

    Args:
        model: the frozen model, already in its frozen state (e.g. under ``disable_adapter``).
        store: read (and fill) this store of the same frozen model instead of running private passes; the same
            chunks, so the same centre bit for bit.
    """
    layers = list(range(num_layers(model) + 1))
    if store is None:
        h, _ = response_states(model, harmful, pad_id, layers, chunk)
        b, _ = response_states(model, benign, pad_id, layers, chunk)
    else:
        dev = next(model.parameters()).device

        def run(batch, k):
            return forward(model, batch.attention_mask, input_ids=batch.input_ids, logits_last=k)

        h, b = (torch.cat([x.float().cpu() for x in store.get(pairs, run, pad_id, dev).select(layers)], dim=1)
                for pairs in (harmful, benign))  # fmt: skip
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
        store: with ``optim.cache_frozen``, the :class:`FrozenStore` of this model's frozen reference (shared by
            every trainer on the same stage 0 and the centre); a private one when None.
    """

    def __init__(self, kind: str, model, cfg: DefenseCfg | SftCfg, harmful: list[Pair], benign: list[Pair],
                 pad_id: int, run=None, step_offset: int = 0, seed: int = 0, center: Tensor | None = None,
                 retain: list[Pair] | None = None, store: FrozenStore | None = None):  # fmt: skip
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
        on = dist.is_available() and dist.is_initialized()
        self.world, self.rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)
        if self.world > 1:
            for name, pairs in (("harmful", harmful), ("benign", benign), ("retain", retain or [])):
                n = min(cfg.optim.batch_size, len(pairs))
                if pairs and n % self.world:
                    raise ValueError(
                        f"{kind}: {name} batch of {n} rows does not split over {self.world} ranks"
                    )
        self.rng = random.Random(seed)
        self.params = [p for p in model.parameters() if p.requires_grad]
        # whole replicas under torchrun: PyTorch's DDP averages the adapters' gradients (bucketed, overlapped with
        # backward) and the step's loss (all its forwards, mining included) is one DDP forward; an FSDP2-sharded
        # model reduces its gradients itself
        self.ddp = wrap_ddp(model) if self.world > 1 and not isinstance(model, FSDPModule) else None
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
            if m.harmful_pass not in MINING_HARMFUL_PASSES:
                raise ValueError(
                    f"mining.harmful_pass must be one of {MINING_HARMFUL_PASSES}, got {m.harmful_pass!r}"
                )
            self.attacker = LatentAttacker(d_model, blocks, m.lr, self.device, init=m.init)
            self._gen = torch.Generator().manual_seed(seed)
            # the attack draws its own batches and coin flips, so CRL and CRL+mining see the same training batches
            self.adv_rng = random.Random(seed + 1)
        self._frozen: dict[str, FrozenRows] = {}
        self.store = (store or FrozenStore(f"{kind} reference")) if cfg.optim.cache_frozen else None
        self.center = None
        if kind != "sft" and cfg.center_states:
            if center is None:
                with model.disable_adapter():
                    center = state_means(model, harmful, benign, pad_id, store=self.store)
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

    def _token_spec(self, which: str = "harmful") -> str:
        """Tokens whose states a term reads: 'response', CRL's 'last', or RR's request + response ('all')."""
        if self.kind in ("crl", "crl_adv") and self.cfg.crl.tokens == "last":
            return "last"
        if self.kind == "rr":
            rr = self.cfg.rr
            spec = rr.reroute_tokens if which == "harmful" else rr.retain_tokens
            if spec not in ("all", "response"):
                raise ValueError(f"rr token spec must be 'all' or 'response', got {spec!r}")
            return spec
        return "response"

    def _token_mask(self, batch: Batch, which: str = "harmful") -> Tensor:
        spec = self._token_spec(which)
        if spec == "last":
            return L.last_token_mask(batch.response_mask)
        return batch.attention_mask.bool() if spec == "all" else batch.response_mask

    # ------------------------------------------------------------------ ranks
    def _local(self, batch: Batch) -> Batch:
        """This rank's contiguous rows of a global batch (the batch itself on one process)."""
        if self.world == 1:
            return batch
        sl = shard(batch.input_ids.shape[0], self.rank, self.world)
        return Batch(batch.input_ids[sl], batch.attention_mask[sl], batch.response_mask[sl], batch.n_response)

    def _fwd(self, batch: Batch, **kw):
        """Forward of this rank's rows of the global ``batch``."""
        b = self._local(batch)
        return forward(self.model, b.attention_mask, input_ids=b.input_ids, **kw)

    def _hidden(self, out, layers: list[int], grad: bool = True):
        """Hidden states of the global batch: ``out.hidden_states`` on one process, else ``{layer: [batch, pos,
        d_model]}`` gathered across ranks (differentiably when ``grad``)."""
        if self.world == 1:
            return out.hidden_states
        x = torch.stack([out.hidden_states[i] for i in layers], 1)  # [rows, layers, pos, d_model]
        x = all_gather_with_grad(x) if grad else all_gather_nograd(x)
        return {i: x[:, k] for k, i in enumerate(layers)}

    def _ranks_sum(self, part: Tensor) -> Tensor:
        """A term that is a sum over rows, from this rank's share ``part``: its value is the global sum, its
        gradient ``world`` times the share's, like the gathered terms (FSDP then averages over ranks)."""
        if self.world == 1:
            return part
        total = part.detach().clone()
        dist.all_reduce(total)
        return self.world * part - (self.world - 1) * part.detach() + (total - part.detach())

    def _global_count(self, n: Tensor | int) -> Tensor:
        n = torch.as_tensor(n, dtype=torch.float32, device=self.device).clone()
        if self.world > 1:
            dist.all_reduce(n)
        return n

    @torch.no_grad()
    def _frozen_pass(self, batch: Batch, layers: list[int], logits: bool,
                     which: str = "harmful") -> tuple[list[Tensor], list[Tensor] | None]:  # fmt: skip
        """Frozen (adapters disabled) states per row of ``batch`` and response logits per row this rank owns
        (``cache_frozen=false``: every step; each rank runs its rows and the states are gathered)."""
        run = self._local(batch)
        with self.model.disable_adapter():
            out = forward(self.model, run.attention_mask, input_ids=run.input_ids, hidden=bool(layers),
                          logits_last=batch.n_response + 1 if logits else 1)  # fmt: skip
        mask = self._token_mask(batch, which)
        hidden = self._hidden(out, layers, grad=False) if layers else out.hidden_states
        states = [torch.stack([hidden[i][r][mask[r]] for i in layers]) if layers else torch.empty(0)
                  for r in range(mask.shape[0])]  # fmt: skip
        rows = None
        if logits:
            lg, _, m = response_logits(out.logits, run)
            rows = [lg[r][m[r]] for r in range(m.shape[0])]
        return states, rows

    def _frozen_rows(self, which: str, pairs: list[Pair], idx: list[int], batch: Batch, logits: bool):
        """Frozen states of every row of the global batch ``[layers, n_tok, d_model]`` and response logits of
        this rank's rows ``[n_resp_tok, d_vocab]``."""
        layers = self.layers.get(which, [])
        if not self.cfg.optim.cache_frozen:
            states, rows = self._frozen_pass(batch, layers, logits, which)
            return torch.cat(states, dim=1) if layers else None, torch.cat(rows) if logits else None
        if which not in self._frozen:  # every layer and token of each pair once per stage 0 (frozen.py)
            entry = self.store.get(pairs, self._frozen_forward, self.pad_id, self.device, logits=logits)
            states = (
                entry.select(layers, self._token_spec(which)) if layers else [torch.empty(0)] * len(pairs)
            )
            self._frozen[which] = FrozenRows(states, list(entry.logits) if logits else None)
        c = self._frozen[which]
        states = torch.cat([c.states[i] for i in idx], dim=1) if layers else None
        mine = idx[shard(len(idx), self.rank, self.world)] if self.world > 1 else idx
        return states, torch.cat([c.logits[i] for i in mine]) if logits else None

    def _frozen_forward(self, batch: Batch, logits_last: int):
        """The frozen reference on a whole batch (every rank runs it, so every rank holds the same store)."""
        with self.model.disable_adapter():
            return forward(
                self.model, batch.attention_mask, input_ids=batch.input_ids, logits_last=logits_last
            )

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
        oh = self._fwd(bh, hidden=False, logits_last=bh.n_response + 1)
        lg, tg, m = response_logits(oh.logits, self._local(bh))
        ce_h = self._token_mean(lambda red: F.cross_entropy(lg[m].float(), tg[m], reduction=red), m)
        ob = self._fwd(bb, hidden=False, logits_last=bb.n_response + 1)
        lg, tg, m = response_logits(ob.logits, self._local(bb))
        ce_b = self._token_mean(lambda red: F.cross_entropy(lg[m].float(), tg[m], reduction=red), m)
        _, frozen = self._frozen_rows("benign", self.benign, ib, bb, logits=True)
        kl = self._token_mean(
            lambda red: L.kl_retain(frozen, lg[m], c.temperature) * (1 if red == "mean" else m.sum()), m
        )
        loss = ce_h + c.benign_ce_weight * ce_b + c.kl_weight * kl
        return loss, {"ce_refusal": ce_h.item(), "ce_benign": ce_b.item(), "kl": kl.item()}

    def _token_mean(self, term, mask: Tensor) -> Tensor:
        """Mean over the masked tokens of the global batch of ``term(reduction)`` (``'mean'`` or ``'sum'`` over
        this rank's tokens): exactly today's mean on one process, local sum / global count across ranks."""
        if self.world == 1:
            return term("mean")
        return self._ranks_sum(term("sum") / self._global_count(mask.sum()))

    def _loss_rr(self, step: int, bh: Batch, bb: Batch, ih: list[int], ib: list[int]):
        c = self.cfg.rr
        c_retain, c_reroute = L.rr_coefficients(step, c.schedule_steps or self.steps, c.alpha)
        oh = self._fwd(bh, logits_last=1)
        lh = self.layers["harmful"]
        h_harm = L.select_tokens(self._hidden(oh, lh), lh, self._token_mask(bh, "harmful"))
        f_harm, _ = self._frozen_rows("harmful", self.harmful, ih, bh, logits=False)
        reroute = L.rr_reroute_loss(self._c(h_harm, lh), self._c(f_harm, lh))
        ob = self._fwd(bb, logits_last=1)
        lb = self.layers["benign"]
        h_ben = L.select_tokens(self._hidden(ob, lb), lb, self._token_mask(bb, "benign"))
        f_ben, _ = self._frozen_rows("benign", self.benign, ib, bb, logits=False)
        retain = L.rr_retain_loss(h_ben, f_ben, c.retain_scale)
        loss = c.retain_weight * c_retain * retain + c_reroute * reroute
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
        with torch.random.fork_rng(devices=[]), section("mining"):
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
        both = adv and self.cfg.mining.harmful_pass == "both"
        if adv:
            with self.attacker.module.attach(self.model):
                oh = self._fwd(bh, logits_last=1)
        else:
            oh = self._fwd(bh, logits_last=1)
        harm_states = lambda o: self._c(L.select_tokens(self._hidden(o, union), union, mh), union)  # noqa: E731
        h_harm = harm_states(oh)  # [union, n_tok, d_model]
        # with 'both' the clean states join the attacked ones: [union, 2 n_tok, d_model], frozen rows doubled below
        if both:
            h_harm = torch.cat([harm_states(self._fwd(bh, logits_last=1)), h_harm], dim=1)
        mu = L.harmful_centroid(h_harm, c.detach_centroid)  # [union, 1, d_model]
        pick = lambda layers: [union.index(i) for i in layers]  # noqa: E731
        benign_kl = c.kl_data != "retain"  # the benign batch's logits are needed only for its own KL
        ob = self._fwd(bb, logits_last=bb.n_response + 1 if benign_kl else 1)
        h_ben = self._c(L.select_tokens(self._hidden(ob, lb), lb, mb), lb)
        f_harm, _ = self._frozen_rows("harmful", self.harmful, ih, bh, logits=False)
        f_ben, f_logits = self._frozen_rows("benign", self.benign, ib, bb, logits=benign_kl)
        f_harm, f_ben = self._c(f_harm, lh), self._c(f_ben, lb)
        if both:
            f_harm = torch.cat([f_harm, f_harm], dim=1)
        l_b = L.crl_benign_loss(h_ben, f_ben, mu[pick(lb)], c.d_pos, c.d_neg, c.margin_benign)
        l_h = L.crl_harmful_loss(h_harm[pick(lh)], f_harm, mu[pick(lh)], c.d_harm, c.margin_harmful)
        if c.kl_data == "retain":
            kl = self._kl_retain_set()
        else:
            lg, _, m = response_logits(ob.logits, self._local(bb))
            kl = L.kl_retain(f_logits, lg[m], c.temperature)
            if self.world > 1:  # this rank's token sum over the global token count (or row count)
                n = bb.input_ids.shape[0] if c.kl_reduction == "batchmean" else self._global_count(m.sum())
                kl = self._ranks_sum(kl * m.sum() / n)
            elif c.kl_reduction == "batchmean":  # token mean -> sum per sequence, mean over sequences
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
            frozen = self._fwd(br, hidden=False, logits_last=None).logits
        trained = self._fwd(br, hidden=False, logits_last=None).logits
        mask = self._local(br).attention_mask.bool()
        if c.kl_reduction == "batchmean":
            kl = L.kl_retain_batchmean(frozen, trained, mask, c.temperature)
            # this rank's rows: its per-row sums over the global row count
            return self._ranks_sum(kl * mask.shape[0] / br.input_ids.shape[0]) if self.world > 1 else kl
        kl = L.kl_retain(frozen[mask], trained[mask], c.temperature)
        return self._ranks_sum(kl * mask.sum() / self._global_count(mask.sum())) if self.world > 1 else kl

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

    @staticmethod
    def _replicated(modules: dict, optims: dict) -> tuple[dict, dict]:
        """The parts of :meth:`_ckpt_parts` that FSDP does not shard (all but the adapters and their AdamW)."""
        return {k: m for k, m in modules.items() if k != "lora"}, {
            k: o for k, o in optims.items() if k != "opt"
        }

    # ------------------------------------------------------------------ loop
    def checkpointing(self, on: bool) -> None:
        """HF gradient checkpointing of every decoder block, non-reentrant: it needs no input that requires grad
        (the embeddings are frozen) and restores the RNG state on recomputation, so LoRA dropout masks repeat."""
        kw = {"use_reentrant": False}
        if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
            self.model.activation_checkpointing_enable(
                kw
            ) if on else self.model.activation_checkpointing_disable()
        elif on:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        else:
            self.model.gradient_checkpointing_disable()

    def fit(self, callback=None) -> dict[str, float]:
        """Train ``self.steps`` steps, resuming from the latest checkpoint of tag ``kind``.

        Args:
            callback: called as ``callback(done)`` after the optimizer step that completes local step ``done``
                (1-based), before that step's checkpoint, on every rank; it must leave the training state (adapters,
                RNGs) as it found it. Used to measure and snapshot validation points (``select.py``).
        """
        o = self.cfg.optim
        start = 0
        # replicas hold identical adapters and AdamW state, so rank 0's checkpoint is every rank's and all ranks resume
        # from it; an FSDP2-sharded model is checkpointed by every rank through DCP (reprlab.runs.dcp)
        sharded = isinstance(self.model, FSDPModule)  # FSDP2 reduces gradients itself
        saves = self.run is not None
        if saves and self.run.checkpoints(self.kind):
            if self.attacker is not None:  # a placeholder module to load the saved attack into
                self.attacker.refresh(torch.Generator())
            modules, optims, _ = self._ckpt_parts()
            if sharded:
                step, extra = self.run.load_sharded_checkpoint(
                    self.model, self.opt, *self._replicated(modules, optims), tag=self.kind
                )
            else:
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
        ckpt = self.cfg.optim.gradient_checkpointing
        if ckpt:
            self.checkpointing(True)
        self.model.train()
        t0, hist = time.time(), []
        for step in range(start, self.steps):
            t_step = time.time()
            self.opt.zero_grad(set_to_none=True)
            with section("loss"):
                loss, info = self.loss(step) if self.ddp is None else self.ddp(self.loss, step)
            with section("backward"):
                loss.backward()
            with section("optimizer"):
                self.opt.step()
            hist.append({"loss": loss.item(), **info, "step_seconds": time.time() - t_step})
            if self.run is not None and (step % o.log_every == 0 or step == self.steps - 1):
                self.run.log(self.offset + step, **{f"{self.kind}.{k}": v for k, v in hist[-1].items()})
            done = step + 1
            if callback is not None:
                callback(done)
            if saves and (done % o.checkpoint_every == 0 or done == self.steps):
                with section("checkpoint"):
                    modules, optims, extra = self._ckpt_parts()
                    if sharded:  # every rank writes its shards
                        self.run.save_sharded_checkpoint(self.offset + done, self.model, self.opt,
                                                         *self._replicated(modules, optims), extra=extra,
                                                         tag=self.kind)  # fmt: skip
                    else:
                        self.run.save_checkpoint(
                            self.offset + done, modules, optims, extra=extra, tag=self.kind
                        )
        self.model.eval()
        if ckpt:
            self.checkpointing(False)
        tail = hist[-5:]
        out = {k: sum(h[k] for h in tail) / len(tail) for k in (tail[0] if tail else {})}
        out.update(steps=self.steps, resumed_from=start, seconds=time.time() - t0)
        return out


def _tuple_state(state):
    """``random.Random.getstate`` after a JSON round trip (lists) back to tuples."""
    return (state[0], tuple(state[1]), state[2])
