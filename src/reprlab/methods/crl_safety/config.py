"""Typed configs of the CRL-safety pipeline. Defaults are our CPU testbed's [ours] unless marked.

Every default that differs from the official code says so in its help text; see ``losses.py`` and
``mining.py`` for which parts are the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _h(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class LoraCfg:
    r: int = field(default=16, metadata=_h("LoRA rank (code: 16)"))
    alpha: int = field(default=16, metadata=_h("LoRA alpha (code: 16)"))
    dropout: float = field(default=0.05, metadata=_h("LoRA dropout (code: 0.05)"))
    target_modules: str = field(
        default="all-linear", metadata=_h("peft target modules; all-linear = the 7 projections on Llama")
    )
    blocks: str = field(
        default="auto",
        metadata=_h("decoder blocks with adapters: 'auto' = 0..highest target layer, or a layer spec"),
    )


@dataclass(frozen=True)
class OptimCfg:
    steps: int = field(default=60, metadata=_h("optimizer steps"))
    batch_size: int = field(default=4, metadata=_h("sequences per class per step (code: 16 effective)"))
    lr: float = field(default=1e-4, metadata=_h("constant AdamW lr, no weight decay (code: 1e-4)"))
    log_every: int = field(default=5, metadata=_h("metrics.jsonl every N steps"))
    checkpoint_every: int = field(default=20, metadata=_h("checkpoint every N steps"))
    cache_frozen: bool = field(
        default=True, metadata=_h("[ours] precompute frozen states/logits once per example")
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata=_h(
            "recompute each decoder block in the backward pass (HF gradient checkpointing, non-reentrant): "
            "activations of every block but one are not kept, at ~1/3 more compute. GPU recipes: on"
        ),
    )


@dataclass(frozen=True)
class SftCfg:
    """Stage 0 refusal training [ours]: CE on refusals + CE/KL to the base on benign replies."""

    optim: OptimCfg = field(default_factory=lambda: OptimCfg(steps=40, lr=3e-4))
    lora: LoraCfg = field(default_factory=LoraCfg)
    benign_ce_weight: float = field(default=0.5, metadata=_h("CE on the base model's own benign replies"))
    kl_weight: float = field(default=1.0, metadata=_h("KL(base || model) on benign reply tokens"))
    temperature: float = field(default=1.0, metadata=_h("softmax temperature of that KL [ours: 1, plain KL]"))


@dataclass(frozen=True)
class CrlCfg:
    layers_benign: str = field(
        default="third:-2",
        metadata=_h("hidden-state layers of L_b (ours on CPU: ceil(L/3)..L-2; official code: all)"),
    )
    layers_harmful: str = field(
        default="third:-2", metadata=_h("hidden-state layers of L_h (code: 20..30 of 32)")
    )
    tokens: str = field(default="response", metadata=_h("'response' (all response tokens, code) or 'last'"))
    d_pos: str = field(
        default="cosine", metadata=_h("benign positive distance (official code: l2; ours on CPU: cosine)")
    )
    d_neg: str = field(default="cosine", metadata=_h("benign negative distance (code: cosine)"))
    d_harm: str = field(default="cosine", metadata=_h("harmful-term distance (code: cosine)"))
    margin_benign: float = field(default=0.3, metadata=_h("m_b (code 2, paper via TB 500, TB cosine 0.3)"))
    margin_harmful: float = field(default=0.5, metadata=_h("m_h (code 3, paper via TB 1500, TB cosine 0.5)"))
    alpha: float = field(default=0.5, metadata=_h("weight of L_b (code 0.5)"))
    beta: float = field(default=0.4, metadata=_h("weight of L_h (code 0.6, paper via TB 0.4)"))
    kl_weight: float = field(default=0.9, metadata=_h("weight of L_KL (code 0.7, paper via TB 0.9)"))
    temperature: float = field(default=2.0, metadata=_h("KL temperature (code 2)"))
    kl_reduction: str = field(
        default="token_mean",
        metadata=_h(
            "'token_mean' [ours]: mean KL over masked tokens; 'batchmean' (code): sum over a sequence's tokens, mean "
            "over sequences, so the same weight is ~n_tokens times stronger"
        ),
    )
    kl_data: str = field(
        default="benign",
        metadata=_h(
            "'benign' [ours]: the response tokens of the CRL benign batch; 'retain' (code): a separate retain batch "
            "(harmless prompt -> base reply; the code uses UltraChat) over all its non-pad tokens, request included"
        ),
    )
    detach_centroid: bool = field(
        default=False, metadata=_h("stop gradients through mu'_h ([unknown] in the paper)")
    )
    benign_includes_refusals: bool = field(
        default=True,
        metadata=_h("[ours] safe set also holds harmful prompt -> refusal pairs, like WildGuardMix"),
    )
    borderline: str = field(
        default="benign",
        metadata=_h(
            "[ours; docs/crl_safety.md, 'Borderline prompts in the retain term only'] where data.n_borderline_train's "
            "prompts train CRL: 'benign' (the triplet's benign set and the KL retain batch) or 'retain' (the KL retain "
            "batch only, needs kl_data=retain: their replies are kept, their states are not pulled to the benign side)"
        )
        | {"choices": ("benign", "retain")},
    )
    self_written: str = field(
        default="benign",
        metadata=_h(
            "[ours; docs/crl_safety.md, 'Prompts the model writes itself'] where data.n_self_benign's prompts train "
            "CRL: 'benign' (the triplet's benign set and the KL retain batch) or 'retain' (the KL retain batch only, "
            "needs kl_data=retain: their replies are kept, their states are not pulled to the benign side)"
        )
        | {"choices": ("benign", "retain")},
    )


@dataclass(frozen=True)
class RrCfg:
    alpha: float = field(default=10.0, metadata=_h("schedule scale (CB Llama-3: 10)"))
    layers: str = field(default="third,two_thirds", metadata=_h("reroute layers (CB Llama-3: 10,20 of 32)"))
    retain_layers: str = field(default="all", metadata=_h("retain layers (CB: all hidden states)"))
    reroute_tokens: str = field(
        default="all",
        metadata=_h(
            "tokens of the reroute term: 'all' (CB: request and response, the circuit-breaker attention mask) or "
            "'response' (reprlab's earlier default)"
        ),
    )
    retain_tokens: str = field(
        default="all",
        metadata=_h("tokens of the retain term: 'all' (CB: request and response) or 'response'"),
    )
    retain_refusals: bool = field(
        default=True,
        metadata=_h(
            "retain set also holds harmful prompt -> refusal pairs (CB's Llama-3 retain data holds refusals; False = "
            "harmless pairs only, reprlab's earlier default)"
        ),
    )
    retain_scale: str = field(
        default="l2",
        metadata=_h(
            "retain term per token: 'l2' (CB: ||h' - h||_2) or 'relative' [ours, a deviation]: ||h' - h||_2 / ||h||_2. "
            "The reroute gradient scales as 1/||h|| while the L2 retain gradient does not, so on high-norm residual "
            "streams (SmolLM2: centred norms ~100 / ~700 at layers 10 / 20) 'l2' outweighs the reroute term "
            "10^3-10^4 times and RR never moves (measured); 'relative' puts both on the same scale, and at crl-tiny's "
            "32 steps at lr 2e-3 overshoots: benign states move as far as harmful ones (measured, README)"
        )
        | {"choices": ("l2", "relative")},
    )
    retain_weight: float = field(
        default=1.0,
        metadata=_h(
            "[ours] extra factor on the retain term on top of CB's schedule: loss = retain_weight * c_retain * retain "
            "+ c_reroute * reroute (CB: 1). With retain_scale=relative at crl-tiny's budget, 1 lets benign states "
            "move as far as harmful ones, 4-10 hold both still, 3 ends at harmful 0.37 / benign 0.80 centred cos: no "
            "selective value found (measured, README)"
        ),
    )
    steps: int = field(
        default=0,
        metadata=_h(
            "RR's own number of steps; 0 = defense.optim.steps (CB Llama-3: 150, with N = its steps)"
        ),
    )
    schedule_steps: int = field(
        default=0,
        metadata=_h(
            "N of the schedule c_retain = alpha t/(2N); 0 = optim.steps (CB: N = its 150 steps). [ours] A larger N "
            "keeps a short run on the early, reroute-heavy part of CB's schedule"
        ),
    )


MINING_HARMFUL_PASSES = ("attacked", "both")


@dataclass(frozen=True)
class MiningCfg:
    blocks: str = field(
        default="0:third", metadata=_h("decoder blocks the latent attack may sit on (code: 0..9 of 32)")
    )
    refresh_every: int = field(default=20, metadata=_h("train a fresh module every N steps (code 40)"))
    iterations: int = field(default=20, metadata=_h("max iterations per refresh (code 1100) [ours: CPU]"))
    extra_iters: int = field(default=1, metadata=_h("iterations on non-refresh steps (code 1)"))
    lr: float = field(default=1e-3, metadata=_h("Adam lr of the module (code 1e-4) [ours: fewer iterations]"))
    prob: float = field(default=0.25, metadata=_h("probability a step uses the attack (code 0.25)"))
    gate_loss: float = field(
        default=3.0, metadata=_h("use only when the last 10 losses average below this (code 3)")
    )
    stop_loss: float = field(
        default=1.85, metadata=_h("early stop of module training (code 1.85 over 100 its)")
    )
    window: int = field(default=10, metadata=_h("averaging window of the stop rule (code 100) [ours]"))
    harmful_pass: str = field(
        default="attacked",
        metadata=_h(
            "on a step the attack is used: 'attacked' (code) trains on the attacked harmful states in place of the "
            "clean ones; 'both' [ours] trains on the clean and the attacked states of the same batch (one more "
            "forward pass), so mining adds hard negatives without taking the clean harmful signal away"
        )
        | {"choices": MINING_HARMFUL_PASSES},
    )
    init: str = field(
        default="identity",
        metadata=_h(
            "'identity' [ours]: the block output is replaced by W h + b (W = I, so the attack starts as a no-op); "
            "'residual' (code AddedModule): h + (W h + b) with W = I, b = 1e-7, i.e. 2h + b at the start"
        ),
    )


SELECT_RULES = ("last", "benign_floor")
SELECT_FALLBACKS = ("earliest", "balanced")


@dataclass(frozen=True)
class SelectCfg:
    """Which training step of each defence is exported and evaluated [ours]; ``select.py`` holds the rule."""

    rule: str = field(
        default="last",
        metadata=_h(
            "'last': the final step (the paper's fixed schedule as far as we know); 'benign_floor' [ours]: at every "
            "validation point measure benign compliance on data.n_harmless_val validation prompts and prefill ASR on "
            "data.n_harmful_val; keep the latest step whose benign compliance >= stage 0's - tolerance, else the "
            "earliest validation step"
        )
        | {"choices": SELECT_RULES},
    )
    every: int = field(
        default=0,
        metadata=_h("steps between validation points; 0 = optim.checkpoint_every (the last step always)"),
    )
    tolerance: float = field(
        default=0.05,
        metadata=_h("benign_floor: how far below stage 0's validation benign compliance a step may fall"),
    )
    fallback: str = field(
        default="earliest",
        metadata=_h(
            "benign_floor when no step reaches the floor: 'earliest' (the step closest to stage 0; it may defend "
            "nothing) or 'balanced' [ours]: the latest step with the highest validation benign compliance minus "
            "validation prefill ASR"
        )
        | {"choices": SELECT_FALLBACKS},
    )


@dataclass(frozen=True)
class DefenseCfg:
    """One trainer for RR, CRL and CRL+mining; they share optimisation and differ in the loss only."""

    optim: OptimCfg = field(default_factory=OptimCfg)
    lora: LoraCfg = field(default_factory=LoraCfg)
    center_states: bool = field(
        default=True,
        metadata=_h(
            "[ours] subtract the frozen per-layer mean response state (mean of the harmful and benign class means) "
            "before every cosine, for CRL and RR alike; L2 is unaffected. Off = the code's raw states"
        ),
    )
    crl: CrlCfg = field(default_factory=CrlCfg)
    rr: RrCfg = field(default_factory=RrCfg)
    mining: MiningCfg = field(default_factory=MiningCfg)
    select: SelectCfg = field(default_factory=SelectCfg)
