"""TransformerLens interop: our :class:`~reprlab.models.gpt.GPT` as a ``HookedTransformer`` and back.

Our GPT is GPT-2's block (pre-LN, GELU MLP, learned absolute positions, untied embeddings), which
TransformerLens represents exactly with ``normalization_type="LN"``, ``positional_embedding_type="standard"``
and ``act_fn`` ``gelu_new`` (our ``gelu_tanh``) or ``gelu``. The conversion copies weights only; it does
**not** apply TransformerLens's ``from_pretrained`` preprocessing (``fold_ln``, ``center_writing_weights``,
``center_unembed``, ``fold_value_biases``), which would change the residual stream, the LayerNorm inputs
and the neuron basis. So activations at corresponding hook names are equal (tested), not just logits.

Weight layouts (ours is ``nn.Linear``'s (out, in); TransformerLens keeps (in, out) per head):

* ``attn.qkv.weight`` (3·d_model, d_model), rows ``[q | k | v]``, head ``h`` = rows ``h·d_head:(h+1)·d_head``
  of each part -> ``W_Q/W_K/W_V`` (n_heads, d_model, d_head), biases -> ``b_Q/b_K/b_V`` (n_heads, d_head);
* ``attn.proj.weight`` (d_model, d_model), input column ``h·d_head + j`` -> ``W_O`` (n_heads, d_head, d_model);
* ``mlp.fc.weight`` (d_mlp, d_model) -> ``W_in`` (d_model, d_mlp); ``mlp.proj.weight`` -> ``W_out`` (d_mlp, d_model);
* ``unembed.weight`` (d_vocab, d_model) -> ``W_U`` (d_model, d_vocab); ``b_U`` = 0 (ours has no unembedding bias).

Requires the optional extra ``lens`` (``transformer_lens<4``: 4.x removed ``HookedTransformer``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from reprlab.models.gpt import GPT, GPTConfig

_ACT_TO_TL = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
_ACT_FROM_TL = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _require_lens():
    try:
        import transformer_lens
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "TransformerLens interop needs the optional extra: pip install 'reprlab[lens]'"
        ) from e
    if not hasattr(transformer_lens, "HookedTransformer"):  # pragma: no cover
        raise ImportError("transformer_lens>=4 removed HookedTransformer; install 'transformer_lens<4'")
    return transformer_lens


def tl_config(cfg: GPTConfig, dtype: torch.dtype = torch.float32):
    """The ``HookedTransformerConfig`` of a model with this architecture (no weight preprocessing)."""
    tl = _require_lens()
    return tl.HookedTransformerConfig(
        n_layers=cfg.n_layers, d_model=cfg.d_model, n_ctx=cfg.n_ctx, d_head=cfg.d_head, n_heads=cfg.n_heads,
        d_mlp=cfg.d_mlp, d_vocab=cfg.d_vocab, act_fn=_ACT_TO_TL[cfg.act], eps=cfg.ln_eps,
        normalization_type="LN", positional_embedding_type="standard", attention_dir="causal",
        original_architecture="GPT2LMHeadModel", init_weights=False, dtype=dtype,
    )  # fmt: skip


def gpt_to_tl_state_dict(model: GPT) -> dict[str, Tensor]:
    """Our GPT's weights under TransformerLens's names and layouts (see the module docstring)."""
    c = model.cfg
    nh, dh, dm = c.n_heads, c.d_head, c.d_model
    sd = {
        "embed.W_E": model.embed.weight, "pos_embed.W_pos": model.pos_embed.weight,
        "ln_final.w": model.ln_final.weight, "ln_final.b": model.ln_final.bias,
        "unembed.W_U": model.unembed.weight.T,
        "unembed.b_U": torch.zeros(c.d_vocab, dtype=model.unembed.weight.dtype),
    }  # fmt: skip
    for i, b in enumerate(model.blocks):
        p = f"blocks.{i}."
        w, bias = b.attn.qkv.weight, b.attn.qkv.bias  # (3·dm, dm), (3·dm,)
        for j, name in enumerate("QKV"):
            # rows of part j, head h: (dh, dm) -> TL (dm, dh)
            sd[p + f"attn.W_{name}"] = w[j * dm : (j + 1) * dm].view(nh, dh, dm).transpose(1, 2)
            sd[p + f"attn.b_{name}"] = bias[j * dm : (j + 1) * dm].view(nh, dh)
        sd[p + "attn.W_O"] = b.attn.proj.weight.T.reshape(nh, dh, dm)
        sd[p + "attn.b_O"] = b.attn.proj.bias
        sd |= {
            p + "ln1.w": b.ln1.weight, p + "ln1.b": b.ln1.bias, p + "ln2.w": b.ln2.weight, p + "ln2.b": b.ln2.bias,
            p + "mlp.W_in": b.mlp.fc.weight.T, p + "mlp.b_in": b.mlp.fc.bias,
            p + "mlp.W_out": b.mlp.proj.weight.T, p + "mlp.b_out": b.mlp.proj.bias,
        }  # fmt: skip
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def to_hooked_transformer(model: GPT):
    """A ``transformer_lens.HookedTransformer`` with ``model``'s weights, on its device and dtype.

    Logits and activations at corresponding hook names (:func:`tl_hook_name`) equal ours up to float
    rounding (tests: 1e-10 in float64, 1e-5 in float32).
    """
    tl = _require_lens()
    param = next(model.parameters())
    ht = tl.HookedTransformer(tl_config(model.cfg, param.dtype), move_to_device=False)
    if param.device.type != "cpu":  # HookedTransformer.to prints a line; the model is built on the CPU
        ht = ht.to(param.device)
    sd = ht.state_dict()
    ours = gpt_to_tl_state_dict(model)
    missing = set(ours) - set(sd)
    if missing:  # a TransformerLens version with other parameter names: fail, never load partially
        raise KeyError(f"HookedTransformer has no parameters {sorted(missing)}")
    left = [k for k in sd if k not in ours and not k.endswith(("attn.mask", "attn.IGNORE"))]
    if left:
        raise KeyError(f"parameters of HookedTransformer not set from our GPT: {left}")
    sd.update({k: v.to(param.device, param.dtype) for k, v in ours.items()})
    ht.load_state_dict(sd, strict=True)
    return ht.eval() if not model.training else ht


def from_hooked_transformer(ht) -> GPT:
    """Our :class:`GPT` with the weights of a GPT-2-style ``HookedTransformer`` (the inverse conversion).

    Raises:
        ValueError: the model is not representable (other normalisation, folded LayerNorm, rotary or other
            positions, parallel/attention-only blocks, grouped-query or local attention, a non-default
            attention scale, or a non-zero unembedding bias).
    """
    c = ht.cfg
    problems = []
    if c.normalization_type != "LN":
        problems.append(f"normalization_type={c.normalization_type!r} (LNPre means fold_ln was applied)")
    if c.positional_embedding_type != "standard":
        problems.append(f"positional_embedding_type={c.positional_embedding_type!r}")
    if c.act_fn not in _ACT_FROM_TL:
        problems.append(f"act_fn={c.act_fn!r}")
    for flag in ("attn_only", "parallel_attn_mlp", "gated_mlp", "final_rms", "use_local_attn", "use_qk_norm"):
        if getattr(c, flag, False):
            problems.append(f"{flag}=True")
    if getattr(c, "n_key_value_heads", None) not in (None, c.n_heads):
        problems.append(f"n_key_value_heads={c.n_key_value_heads}")
    if c.d_head * c.n_heads != c.d_model:
        problems.append(f"d_head*n_heads={c.d_head * c.n_heads} != d_model={c.d_model}")
    if not c.use_attn_scale or not math.isclose(c.attn_scale, math.sqrt(c.d_head)):
        problems.append(f"attention scale {c.attn_scale} (ours is sqrt(d_head))")
    if c.attention_dir != "causal":
        problems.append(f"attention_dir={c.attention_dir!r}")
    if ht.unembed.b_U.detach().abs().max() > 0:
        problems.append("non-zero unembed.b_U (our GPT has no unembedding bias)")
    if problems:
        raise ValueError("HookedTransformer not representable as our GPT: " + "; ".join(problems))
    cfg = GPTConfig(
        d_vocab=c.d_vocab, n_ctx=c.n_ctx, n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads,
        d_mlp=c.d_mlp, act=_ACT_FROM_TL[c.act_fn], ln_eps=c.eps,
    )  # fmt: skip
    nh, dh, dm = c.n_heads, c.d_head, c.d_model
    sd = {
        "embed.weight": ht.embed.W_E, "pos_embed.weight": ht.pos_embed.W_pos,
        "ln_final.weight": ht.ln_final.w, "ln_final.bias": ht.ln_final.b, "unembed.weight": ht.unembed.W_U.T,
    }  # fmt: skip
    for i, b in enumerate(ht.blocks):
        p = f"blocks.{i}."
        a = b.attn
        # TL (nh, dm, dh) -> our rows (nh·dh, dm), parts stacked [q | k | v]
        sd[p + "attn.qkv.weight"] = torch.cat(
            [w.transpose(1, 2).reshape(nh * dh, dm) for w in (a.W_Q, a.W_K, a.W_V)]
        )
        sd[p + "attn.qkv.bias"] = torch.cat([bb.reshape(nh * dh) for bb in (a.b_Q, a.b_K, a.b_V)])
        sd[p + "attn.proj.weight"] = a.W_O.reshape(nh * dh, dm).T
        sd[p + "attn.proj.bias"] = a.b_O
        sd |= {
            p + "ln1.weight": b.ln1.w, p + "ln1.bias": b.ln1.b, p + "ln2.weight": b.ln2.w, p + "ln2.bias": b.ln2.b,
            p + "mlp.fc.weight": b.mlp.W_in.T, p + "mlp.fc.bias": b.mlp.b_in,
            p + "mlp.proj.weight": b.mlp.W_out.T, p + "mlp.proj.bias": b.mlp.b_out,
        }  # fmt: skip
    model = GPT(cfg).to(device=ht.W_E.device, dtype=ht.W_E.dtype)
    model.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return model.eval()


# our hook name (after ``blocks.{i}.``) -> TransformerLens's; identical names map to themselves
_HOOK_MAP = {
    "hook_resid_pre": "hook_resid_pre", "hook_resid_mid": "hook_resid_mid", "hook_resid_post": "hook_resid_post",
    "attn.hook_z": "attn.hook_z", "attn.hook_out": "hook_attn_out",
    "mlp.hook_pre": "mlp.hook_pre", "mlp.hook_post": "mlp.hook_post", "mlp.hook_out": "hook_mlp_out",
}  # fmt: skip


def tl_hook_name(name: str) -> str:
    """TransformerLens's name for our hook ``name``, e.g. ``blocks.0.attn.hook_out -> blocks.0.hook_attn_out``.

    Our ``hook_embed`` (token + position embedding) is TransformerLens's ``blocks.0.hook_resid_pre``.
    """
    if name == "hook_embed":
        return "blocks.0.hook_resid_pre"
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blocks" and parts[2] in _HOOK_MAP:
        return f"blocks.{parts[1]}.{_HOOK_MAP[parts[2]]}"
    raise KeyError(
        f"no TransformerLens equivalent for hook {name!r}; known: hook_embed, blocks.i.{sorted(_HOOK_MAP)}"
    )
