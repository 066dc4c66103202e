"""Adversarial hard-negative mining: the learned latent attack of CRL [known: ``code/methods/triplet/attack.py``].

A trainable affine map sits on the output of decoder block ``l``. The code's ``AddedModule`` returns
``h + linear(h)`` with ``linear`` initialised to W = I, b = 1e-7, so its attack starts at ``2h + b``
(``MiningCfg.init='residual'``). Our default ``init='identity'`` *replaces* the block output by ``W h + b``, the
identity at initialisation, so the attack starts from the clean model [ours]. Only the module trains (the defended model is frozen for
it): Adam on the cross-entropy of harmful completions, stopping when the mean of the last ``window``
losses falls below ``stop_loss``. The trainer refreshes it at a random block every ``refresh_every`` steps,
gives it ``extra_iters`` iterations on other steps, and with probability ``prob`` (when the recent attack
losses average below ``gate_loss``) runs the harmful forward pass through it, so perturbed harmful states
feed μ′_h and L_h in place of the clean ones; ``MiningCfg.harmful_pass='both'`` [ours] keeps the clean states too.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.crl_safety.chat import Batch, forward, response_logits
from reprlab.methods.crl_safety.layers import find_decoder_layers


class AffineLatentAttack(nn.Module):
    """``h -> W h + b`` (``residual=False``) or ``h -> h + (W h + b)`` (``residual=True``, the code's) on the
    output of one decoder block; W starts at I and b at 1e-7. ``h``: ``[batch, pos, d_model]``."""

    def __init__(self, d_model: int, block: int, bias_init: float = 1e-7, residual: bool = False):
        super().__init__()
        self.block = int(block)
        self.residual = bool(residual)
        self.weight = nn.Parameter(torch.eye(d_model))
        self.bias = nn.Parameter(torch.full((d_model,), bias_init))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h @ self.weight.T + self.bias
        return h + out if self.residual else out

    @contextmanager
    def attach(self, model: nn.Module):
        """Apply the attack inside the ``with`` block through a forward hook on the chosen decoder block.

        The hook runs before every other forward hook of the block (``prepend``), so the block's hidden state as
        the model reports it (``output_hidden_states``) is the attacked one, as when the code's ``AddedModule``
        replaces the layer. transformers 5 records hidden states with forward hooks it installs at the first
        forward that asks for them; appended, the attack would run before or after that recorder depending on
        whether the first such forward happened inside this block, so a run resumed at a step with the attack on
        read other states than the uninterrupted run.
        """
        _, blocks = find_decoder_layers(model)

        def hook(_mod, _inp, out):
            if isinstance(out, tuple):
                return (self(out[0]), *out[1:])
            return self(out)

        handle = blocks[self.block].register_forward_hook(hook, prepend=True)
        try:
            yield self
        finally:
            handle.remove()


def completion_ce(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of the response tokens of ``batch`` (the harmful completions)."""
    out = forward(
        model, batch.attention_mask, input_ids=batch.input_ids, hidden=False, logits_last=batch.n_response + 1
    )
    logits, targets, mask = response_logits(out.logits, batch)
    return F.cross_entropy(logits[mask].float(), targets[mask])


@dataclass
class LatentAttacker:
    """Owns the current attack module, its optimiser and its loss history."""

    d_model: int
    blocks: list[int]
    lr: float
    device: torch.device | str = "cpu"
    module: AffineLatentAttack | None = None
    losses: list[float] = field(default_factory=list)
    n_refresh: int = 0
    init: str = "identity"

    def __post_init__(self):
        if self.init not in ("identity", "residual"):
            raise ValueError(f"mining.init must be 'identity' or 'residual', got {self.init!r}")

    def refresh(self, rng: torch.Generator) -> None:
        block = self.blocks[int(torch.randint(len(self.blocks), (1,), generator=rng))]
        self.module = AffineLatentAttack(self.d_model, block, residual=self.init == "residual").to(
            self.device
        )
        self._opt = torch.optim.Adam(self.module.parameters(), lr=self.lr)
        self.losses = []
        self.n_refresh += 1

    def train(self, model: nn.Module, batches, iterations: int, stop_loss: float, window: int) -> float:
        """Run up to ``iterations`` Adam steps on the module only; returns the last loss.

        Args:
            batches: an iterator yielding harmful-completion :class:`Batch` es.
        """
        assert self.module is not None, "call refresh() first"
        params = list(self.module.parameters())
        for _ in range(iterations):
            with self.module.attach(model):
                loss = completion_ce(model, next(batches))
            # autograd.grad w.r.t. the module only: no gradient is accumulated in the defended model's LoRA
            grads = torch.autograd.grad(loss, params)
            for p, g in zip(params, grads):
                p.grad = g
            self._opt.step()
            self._opt.zero_grad(set_to_none=True)
            self.losses.append(loss.item())
            if len(self.losses) >= window and sum(self.losses[-window:]) / window < stop_loss:
                break
        return self.losses[-1]

    def ready(self, gate_loss: float, window: int = 10) -> bool:
        """The attack is strong enough to use: mean of the last ``window`` losses below ``gate_loss``."""
        recent = self.losses[-window:]
        return bool(recent) and sum(recent) / len(recent) < gate_loss
