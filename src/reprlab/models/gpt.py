"""A small hookable GPT: pre-LN, GELU MLP, learned absolute positions, untied embeddings.

Built for the Reason-to-Rote testbed (models trained from scratch on synthetic tasks) and reusable by any
interpretability code: every residual stream, attention output and MLP neuron activation passes through a
named :class:`~reprlab.hooks.HookPoint` (names in :mod:`reprlab.hooks.sites`). The block is GPT-2's
(``resid_mid = resid_pre + attn(ln1(resid_pre))``, ``resid_post = resid_mid + mlp(ln2(resid_mid))``), so
:func:`from_hf_gpt2` loads a ``GPT2LMHeadModel``'s weights and reproduces its logits (tested). Attention
uses ``F.scaled_dot_product_attention`` with a causal mask; sequences are right-padded, so no padding
mask is needed for positions before the padding.

Speed [ours, profiled in ``benchmarks/bench_rote.py``; ``docs/reason_to_rote.md`` has the profile]: on the CPU,
PyTorch's flash-attention kernel is about 2x slower per position when the length is not a multiple of 16
(15 for FDA: 2.0 vs 1.1 ms forward + backward for 64 x 4 heads), so attention pads queries, keys and values
with zeros at the end to a multiple of 16 and drops the padded rows (causal: real positions never attend to
them). ``forward(ids, start=k)`` computes the last block's MLP, the final LayerNorm and the unembedding only
at positions ``>= k`` (the answer span of an answer-only loss), which no full-sequence model can skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reprlab.hooks.hook_point import HookPoint


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of :class:`GPT` (our defaults [ours]; the larger FDA recipe uses 4 layers, d_model 128)."""

    d_vocab: int = field(default=16, metadata={"help": "vocabulary size"})
    n_ctx: int = field(default=32, metadata={"help": "maximum sequence length (learned positions)"})
    n_layers: int = field(default=2, metadata={"help": "number of transformer blocks"})
    d_model: int = field(default=128, metadata={"help": "residual width"})
    n_heads: int = field(default=4, metadata={"help": "attention heads per block"})
    d_mlp: int = field(default=512, metadata={"help": "MLP hidden width (number of neurons per layer)"})
    act: str = field(default="gelu_tanh", metadata={"help": "gelu_tanh (GPT-2's gelu_new) or gelu (erf)"})
    ln_eps: float = field(default=1e-5, metadata={"help": "LayerNorm epsilon"})
    init_std: float = field(default=0.02, metadata={"help": "std of the normal weight init (GPT-2's)"})

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.act not in ("gelu_tanh", "gelu"):
            raise ValueError(f"act must be 'gelu_tanh' or 'gelu', got {self.act!r}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


class Attention(nn.Module):
    """Causal multi-head self-attention with hooks ``hook_z`` (per head) and ``hook_out``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.d_head = cfg.n_heads, cfg.d_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.hook_z = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """x: (batch, pos, d_model) -> (batch, pos - start, d_model): keys and values at every position, the
        output (``hook_z`` onwards) only for queries ``>= start``."""
        batch, pos, d_model = x.shape
        qkv = self.qkv(x)  # (batch, pos, 3 * d_model)
        padded = pos + _attn_pad(pos, x.device)
        if padded != pos:  # zero rows at the end: later positions, never attended to by real ones (causal)
            qkv = F.pad(qkv, (0, 0, 0, padded - pos))
        # (batch, n_heads, padded, d_head): the layout SDPA expects
        q, k, v = (
            t.view(batch, padded, self.n_heads, self.d_head).transpose(1, 2) for t in qkv.split(d_model, -1)
        )
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, start:pos]
        z = self.hook_z(z.transpose(1, 2))  # (batch, pos - start, n_heads, d_head)
        return self.hook_out(self.proj(z.reshape(batch, pos - start, d_model)))


def _attn_pad(pos: int, device: torch.device) -> int:
    """Zero positions to append so that the CPU flash-attention kernel sees a multiple of 16 [ours].

    Only on the CPU and only for short sequences (<= 64), where the measured gain holds; CUDA kernels are
    not affected.
    """
    if device.type != "cpu" or pos > 64:
        return 0
    return -pos % 16


class MLP(nn.Module):
    """``proj(gelu(fc(x)))`` with hooks ``hook_pre``, ``hook_post`` (the neurons) and ``hook_out``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.proj = nn.Linear(cfg.d_mlp, cfg.d_model)
        self.approximate = "tanh" if cfg.act == "gelu_tanh" else "none"
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, x: Tensor) -> Tensor:
        """x: (batch, pos, d_model) -> (batch, pos, d_model); neurons are (batch, pos, d_mlp)."""
        neurons = self.hook_post(F.gelu(self.hook_pre(self.fc(x)), approximate=self.approximate))
        return self.hook_out(self.proj(neurons))


class Block(nn.Module):
    """Pre-LN transformer block with residual hooks ``hook_resid_pre/mid/post``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.mlp = MLP(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """x: (batch, pos, d_model) -> (batch, pos - start, d_model): attention reads every position; its
        output projection and the MLP run only at positions >= ``start`` (``attn.hook_z`` and every later hook
        of the block then see only those positions)."""
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x[:, start:] + self.attn(self.ln1(x), start))
        return self.hook_resid_post(x + self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """Decoder-only transformer: ``ids (batch, pos) -> logits (batch, pos, d_vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.n_ctx, cfg.d_model)
        self.hook_embed = HookPoint()  # token + position embedding, = blocks.0.hook_resid_pre
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_final = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab, bias=False)
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        # GPT-2's init: N(0, 0.02) weights, zero biases; LayerNorm stays at (1, 0)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.cfg.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        """ids: (batch, pos) int64 with pos <= n_ctx -> logits (batch, pos - start, d_vocab).

        ``start > 0`` returns the logits of positions ``start..pos-1`` only, equal to ``forward(ids)[:, start:]``
        up to float rounding (tested): the last block's attention output projection and MLP, the final
        LayerNorm and the unembedding run on those rows only. For training losses that read a suffix (answer-only loss); hooks of the last block
        after its attention then see ``pos - start`` positions.
        """
        pos = ids.shape[1]
        if pos > self.cfg.n_ctx:
            raise ValueError(f"sequence length {pos} exceeds n_ctx={self.cfg.n_ctx}")
        if not 0 <= start < pos:
            raise ValueError(f"start={start} must be in [0, {pos})")
        x = self.hook_embed(self.embed(ids) + self.pos_embed.weight[:pos])
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            x = block(x, start if i == last else 0)
        if last < 0:  # no blocks: the embedding goes straight to the unembedding
            x = x[:, start:]
        return self.unembed(self.ln_final(x))

    def hook_names(self) -> list[str]:
        """All hook names of this model, in forward order."""
        return [n for n, m in self.named_modules() if isinstance(m, HookPoint)]


def from_hf_gpt2(hf_model: nn.Module) -> GPT:
    """Build a :class:`GPT` carrying the weights of a ``transformers.GPT2LMHeadModel``.

    GPT-2's ``Conv1D`` stores weights as (in, out), so they are transposed into ``nn.Linear``'s (out, in).
    The HF model must use ``gelu_new``/``gelu`` and no extra features (no cross-attention, scale_attn
    options at their defaults).
    """
    hc = hf_model.config
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}.get(
        hc.activation_function
    )
    if act is None:
        raise ValueError(f"unsupported GPT-2 activation {hc.activation_function!r}")
    cfg = GPTConfig(
        d_vocab=hc.vocab_size, n_ctx=hc.n_positions, n_layers=hc.n_layer, d_model=hc.n_embd,
        n_heads=hc.n_head, d_mlp=hc.n_inner or 4 * hc.n_embd, act=act, ln_eps=hc.layer_norm_epsilon,
    )  # fmt: skip
    model = GPT(cfg)
    t = hf_model.transformer
    sd = {
        "embed.weight": t.wte.weight, "pos_embed.weight": t.wpe.weight,
        "ln_final.weight": t.ln_f.weight, "ln_final.bias": t.ln_f.bias,
        "unembed.weight": hf_model.lm_head.weight,
    }  # fmt: skip
    for i, h in enumerate(t.h):
        p = f"blocks.{i}."
        sd.update({
            p + "ln1.weight": h.ln_1.weight, p + "ln1.bias": h.ln_1.bias,
            p + "ln2.weight": h.ln_2.weight, p + "ln2.bias": h.ln_2.bias,
            p + "attn.qkv.weight": h.attn.c_attn.weight.T, p + "attn.qkv.bias": h.attn.c_attn.bias,
            p + "attn.proj.weight": h.attn.c_proj.weight.T, p + "attn.proj.bias": h.attn.c_proj.bias,
            p + "mlp.fc.weight": h.mlp.c_fc.weight.T, p + "mlp.fc.bias": h.mlp.c_fc.bias,
            p + "mlp.proj.weight": h.mlp.c_proj.weight.T, p + "mlp.proj.bias": h.mlp.c_proj.bias,
        })  # fmt: skip
    model.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return model


def to_hf_gpt2(model: GPT):
    """The inverse of :func:`from_hf_gpt2`: a ``GPT2LMHeadModel`` with this model's weights (benchmarks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.cfg
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}[c.act]
    hc = GPT2Config(
        vocab_size=c.d_vocab, n_positions=c.n_ctx, n_embd=c.d_model, n_layer=c.n_layers, n_head=c.n_heads,
        n_inner=c.d_mlp, activation_function=act, layer_norm_epsilon=c.ln_eps, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    hf = GPT2LMHeadModel(hc)
    t = hf.transformer
    with torch.no_grad():
        t.wte.weight.copy_(model.embed.weight)
        t.wpe.weight.copy_(model.pos_embed.weight)
        t.ln_f.weight.copy_(model.ln_final.weight)
        t.ln_f.bias.copy_(model.ln_final.bias)
        hf.lm_head.weight.copy_(model.unembed.weight)
        for h, b in zip(t.h, model.blocks):
            for dst, src in ((h.ln_1, b.ln1), (h.ln_2, b.ln2)):
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
            for dst, src in ((h.attn.c_attn, b.attn.qkv), (h.attn.c_proj, b.attn.proj),
                             (h.mlp.c_fc, b.mlp.fc), (h.mlp.c_proj, b.mlp.proj)):  # fmt: skip
                dst.weight.copy_(src.weight.T)
                dst.bias.copy_(src.bias)
    return hf
