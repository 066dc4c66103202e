"""Resolve hook names to (module, kind) sites, for our GPT and for Hugging Face causal LMs.

Hook names follow one vocabulary for every model:

* ``blocks.{i}.hook_resid_pre`` / ``hook_resid_mid`` / ``hook_resid_post``: residual stream (batch, pos, d_model)
* ``blocks.{i}.attn.hook_z``: per-head attention output before the output projection (batch, pos, n_heads, d_head)
* ``blocks.{i}.attn.hook_out``: attention output added to the residual (batch, pos, d_model)
* ``blocks.{i}.mlp.hook_post``: MLP neuron activations, the input of the output projection (batch, pos, d_mlp)
* ``blocks.{i}.mlp.hook_out``: MLP output added to the residual (batch, pos, d_model)

For our GPT (``reprlab.models.gpt``) every name is a ``HookPoint`` submodule. For a Hugging Face model the
adapter maps names onto its modules: ``resid_pre`` is the input of decoder layer ``i``, ``resid_post`` its
output, ``mlp.hook_post`` the input of the MLP down-projection (``c_proj`` / ``down_proj``: for gated MLPs
this is ``act(gate) * up``, the tensor whose coordinates are the neurons), ``attn.hook_z`` the input of the
attention output projection (``c_proj`` / ``o_proj``) viewed as (batch, pos, n_heads, d_head), which is the
same tensor as our GPT's ``hook_z``. ``resid_mid`` does not exist as a tensor in HF models and raises
``KeyError`` naming the available sites.

A module that holds a HF causal LM as ``hf_model`` (:class:`reprlab.models.hf_lm.HFCausalLM`, which gives it
our GPT's ``ids -> logits`` call) resolves to that model's sites, so every analysis runs on it unchanged.
Edge circuits also need, per block, the modules that *read* the residual stream (the norms before attention
and MLP, :func:`block_norms`) and each head's slice of the attention output projection
(:func:`head_out_weight`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from reprlab.hooks.hook_point import HookPoint


@dataclass(frozen=True)
class Site:
    """Where a named activation lives.

    Attributes:
        module: the module to hook.
        kind: ``"output"`` (the module's output, first element if a tuple) or ``"input"`` (its first
            positional input or ``hidden_states`` keyword).
    """

    module: nn.Module
    kind: Literal["output", "input"]
    # "input" sites holding concatenated heads set this: hooks see (batch, pos, heads, d_head)
    heads: int | None = None


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a wrapper that holds one as ``hf_model``; any other model unchanged."""
    return getattr(model, "hf_model", model)


def _hf_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(decoder layers, final norm, unembedding) of a HF causal LM (GPT-2 and Llama-style layouts)."""
    model = unwrap(model)
    if hasattr(model, "transformer") and hasattr(model.transformer, "h"):  # GPT-2, GPT-J style
        return model.transformer.h, model.transformer.ln_f, model.get_output_embeddings()
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(inner, "norm"):  # Llama, Mistral, Qwen
        return inner.layers, inner.norm, model.get_output_embeddings()
    raise TypeError(
        f"unsupported model layout {type(model).__name__}: expected `transformer.h` (GPT-2) or "
        "`model.layers` + `model.norm` (Llama-style)"
    )


def is_hooked_gpt(model: nn.Module) -> bool:
    """True for models that carry their own ``HookPoint`` modules (``reprlab.models.gpt.GPT``)."""
    return any(isinstance(m, HookPoint) for m in model.modules())


def n_layers(model: nn.Module) -> int:
    """Number of transformer blocks of a hooked GPT or a HF causal LM."""
    if is_hooked_gpt(model):
        return len(model.blocks)
    return len(_hf_parts(model)[0])


def final_norm_and_unembed(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(final LayerNorm/RMSNorm, unembedding Linear)``: what the logit lens applies to a residual."""
    if is_hooked_gpt(model):
        return model.ln_final, model.unembed
    _, norm, head = _hf_parts(model)
    return norm, head


_HF_PATTERN = re.compile(
    r"^blocks\.(\d+)\.(hook_resid_pre|hook_resid_post|attn\.hook_out|attn\.hook_z|mlp\.hook_out|mlp\.hook_post)$"
)


def resolve(model: nn.Module, name: str) -> Site:
    """Map a hook name to its :class:`Site`; unknown names raise ``KeyError`` listing valid ones."""
    if is_hooked_gpt(model):
        modules = dict(model.named_modules())
        mod = modules.get(name)
        if not isinstance(mod, HookPoint):
            valid = [n for n, m in modules.items() if isinstance(m, HookPoint)]
            raise KeyError(f"unknown hook {name!r}; valid hooks: {valid}")
        return Site(mod, "output")
    match = _HF_PATTERN.match(name)
    model = unwrap(model)
    layers, _, _ = _hf_parts(model)
    if match is None or int(match.group(1)) >= len(layers):
        raise KeyError(
            f"unknown hook {name!r} for {type(model).__name__}; valid: blocks.{{0..{len(layers) - 1}}}."
            "{hook_resid_pre, hook_resid_post, attn.hook_out, attn.hook_z, mlp.hook_out, mlp.hook_post}"
        )
    layer = layers[int(match.group(1))]
    what = match.group(2)
    if what == "hook_resid_pre":
        return Site(layer, "input")
    if what == "hook_resid_post":
        return Site(layer, "output")
    attn = _attn(layer)
    mlp = layer.mlp
    if what == "attn.hook_out":
        return Site(attn, "output")
    if what == "attn.hook_z":
        return Site(_out_proj(attn), "input", heads=int(model.config.num_attention_heads))
    if what == "mlp.hook_out":
        return Site(mlp, "output")
    down = getattr(mlp, "c_proj", None) or getattr(mlp, "down_proj", None)
    if down is None:
        raise KeyError(f"cannot find the MLP down-projection (c_proj/down_proj) of {type(mlp).__name__}")
    return Site(down, "input")


def _attn(layer: nn.Module) -> nn.Module:
    return getattr(layer, "attn", None) or layer.self_attn


def _out_proj(attn: nn.Module) -> nn.Module:
    out_proj = getattr(attn, "c_proj", None) or getattr(attn, "o_proj", None)
    if out_proj is None:
        raise KeyError(f"no attention output projection (c_proj/o_proj) in {type(attn).__name__}")
    return out_proj


def n_heads(model: nn.Module) -> int:
    """Attention heads per block of a hooked GPT or a HF causal LM."""
    if is_hooked_gpt(model):
        return model.cfg.n_heads
    return int(unwrap(model).config.num_attention_heads)


def block_norms(model: nn.Module, i: int) -> tuple[nn.Module, nn.Module]:
    """``(norm before attention, norm before the MLP)`` of block ``i``: the modules whose input is what the
    attention layer and the MLP read from the residual stream (pre-norm blocks: GPT-2, Llama-style, ours)."""
    if is_hooked_gpt(model):
        block = model.blocks[i]
        return block.ln1, block.ln2
    layer = _hf_parts(model)[0][i]
    for first, second in (("ln_1", "ln_2"), ("input_layernorm", "post_attention_layernorm")):
        if hasattr(layer, first) and hasattr(layer, second):
            return getattr(layer, first), getattr(layer, second)
    raise TypeError(f"{type(layer).__name__}: no pre-attention/pre-MLP norms (ln_1/ln_2 or "
                    "input_layernorm/post_attention_layernorm); a post-norm or parallel block has no edge graph")  # fmt: skip


def head_out_weight(model: nn.Module, i: int) -> Tensor:
    """(d_model, n_heads, d_head) attention output projection of block ``i``, split by head: head ``h``
    writes ``z_h @ W[:, h].T`` into the residual stream (the projection's bias belongs to no head)."""
    if is_hooked_gpt(model):
        proj = model.blocks[i].attn.proj.weight  # nn.Linear: (out = d_model, in = n_heads * d_head)
    else:
        out_proj = _out_proj(_attn(_hf_parts(model)[0][i]))
        # GPT-2's Conv1D stores (in, out); nn.Linear (Llama-style o_proj) stores (out, in)
        proj = out_proj.weight.T if type(out_proj).__name__ == "Conv1D" else out_proj.weight
    return proj.view(proj.shape[0], n_heads(model), -1)
