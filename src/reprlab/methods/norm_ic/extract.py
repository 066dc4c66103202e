"""Batched per-layer token states of Hugging Face encoders and decoders, for single words or texts.

Each item (a word, or a text prefix) is tokenised on its own and laid out as

* encoder (BERT family): ``[CLS] pieces [SEP]``; the *pooled* state is the CLS state (position 0), or, with a
  ``pool`` function (a sentence-transformers pipeline's own modules), that function of the whole sequence;
* decoder (LLaMA family): ``context pieces [EOS]``; the pooled state is the appended EOS state [paper:
  "LLaMA's EOS"]. ``context`` is one special token [ours] so the text is not at position 0, whose state is
  an attention sink with a norm ~10× larger than any other (measured on SmolLM2: 6700 vs 560).

Special tokens are left out of the composed ``pieces`` [ours] and reported separately as ``pooled``.

Truncation is never silent: by default every piece the model accepts is kept (its context minus the two
special tokens); an item longer than that, or than an explicit ``max_pieces``, raises :class:`TruncationError`
(``on_truncate="error"``) or is cut with a logged and ``warnings.warn`` warning that counts the cut items and
pieces (``on_truncate="warn"``); :attr:`TokenStates.n_pieces` keeps every item's untruncated length. Cutting
prefixes silently manufactures a length fixed point (measured: MiniLM's CLS ``cos_to_final_2nd_half`` was
0.9946 at 64 pieces against 0.9686 at 512 on one 80-word document).

For decoders the model's final RMSNorm is bypassed by reading its *input* through a forward hook: the
normalised last state has its norm fixed by the norm's gain, which would erase the quantity under study
[ours].
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reprlab.errors import ConfigError, DataError

log = logging.getLogger(__name__)
N_SPECIAL = 2  # encoder: [CLS] … [SEP]; decoder: context token … EOS


class TruncationError(DataError):
    """An item has more pieces than the model (or ``max_pieces``) accepts, and ``on_truncate="error"``."""


@dataclass
class TokenStates:
    """Token states of ``n`` items, padded to ``pos`` pieces.

    Attributes:
        states: ``(n, n_layers_sel, pos, d_model)`` float32, piece states per selected layer (padding zero).
        pooled: ``(n, n_layers_sel, d_pooled)``, the CLS (encoder) or appended EOS (decoder) state, or the
            ``pool`` function's output for each selected layer.
        mask: ``(n, pos)`` bool, True on real pieces.
        piece_ids: ``(n, pos)`` long, token ids of the pieces (padding −1), for input-table lookups.
        layers: the hidden-state indices kept (0 = embedding output, n_layers = last block).
        surprisal: ``(n, pos)`` nats, −ln p(piece_i | context, pieces_<i) for decoders, else None.
        n_pieces: ``(n,)`` long, each item's piece count *before* any truncation (> ``mask.sum(1)`` = cut).
        limit: the piece limit that applied.
    """

    states: Tensor
    pooled: Tensor
    mask: Tensor
    piece_ids: Tensor
    layers: list[int]
    surprisal: Tensor | None = None
    n_pieces: Tensor | None = None
    limit: int = 0

    @property
    def n_truncated(self) -> int:
        """How many items lost pieces to the limit."""
        return 0 if self.n_pieces is None else int((self.n_pieces > self.mask.sum(1)).sum())


def n_layers_of(model: nn.Module) -> int:
    return config_layers(model.config)


def config_layers(cfg) -> int:
    """Transformer blocks of a HF config (a multimodal one keeps them in its ``text_config``)."""
    return int(getattr(cfg, "num_hidden_layers", None) or cfg.text_config.num_hidden_layers)


def resolve_layers(model: nn.Module, layers: Sequence[int], key: str = "layers") -> list[int]:
    """Map negative layer indices (−1 = last block) to hidden-state indices and validate them."""
    return check_layers(layers, n_layers_of(model), key)


def check_layers(layers: Sequence[int], n: int, key: str = "layers") -> list[int]:
    """:func:`resolve_layers` for a model of ``n`` blocks; ``key`` is the config key the error names."""
    out = [layer if layer >= 0 else n + 1 + layer for layer in layers]
    bad = [x for x in out if not 0 <= x <= n]
    if bad:
        raise ConfigError(f"{key}={list(layers)} out of range for a model with {n} layers: valid 0..{n} "
                          f"(0 = embeddings) or -{n + 1}..-1 (-1 = last)")  # fmt: skip
    return out


def final_norm(model: nn.Module) -> nn.Module | None:
    """The decoder's final normalisation module (``model.model.norm`` for LLaMA-family), if any."""
    base = getattr(model, "model", model)
    for name in ("norm", "final_layernorm", "ln_f"):
        mod = getattr(base, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def context_limit(model: nn.Module, tok=None) -> int:
    """Pieces one item may have: the model's positions (and the tokenizer's limit, if set) minus 2 specials."""
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    limits = [int(v) for v in (getattr(cfg, "max_position_embeddings", None),
                               getattr(tok, "model_max_length", None)) if v and int(v) < 10**7]  # fmt: skip
    if not limits:
        raise ValueError("cannot tell the model's context length: no max_position_embeddings in its config")
    return min(limits) - N_SPECIAL


def piece_ids(tok, texts: Sequence[str], arch: str, max_pieces: int | None = None) -> list[list[int]]:
    """Tokenise each text without special tokens (decoders get a leading space, as inside running text).

    ``max_pieces`` cuts silently and exists for callers that only need ids (e.g. subword frequencies);
    :func:`extract_states` checks and reports truncation itself.
    """
    lead = " " if arch == "decoder" else ""
    out = []
    for t in texts:
        ids = tok(lead + t, add_special_tokens=False)["input_ids"]
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        if not ids:
            raise ValueError(f"text {t!r} tokenises to nothing")
        out.append(list(ids[:max_pieces] if max_pieces else ids))
    return out


def _special_ids(tok, arch: str, context_token: str | None = None) -> tuple[list[int], int]:
    """(ids placed before the pieces, id appended after them)."""
    if arch == "encoder":
        cls_id = tok.cls_token_id if tok.cls_token_id is not None else tok.bos_token_id
        sep_id = tok.sep_token_id if tok.sep_token_id is not None else tok.eos_token_id
        if cls_id is None or sep_id is None:
            raise ValueError("encoder tokenizer has neither CLS/SEP nor BOS/EOS tokens")
        return [cls_id], sep_id
    if arch == "decoder":
        eos = tok.eos_token_id
        if eos is None:
            raise ValueError("decoder tokenizer has no EOS token")
        if context_token:
            ctx = tok.convert_tokens_to_ids(context_token)
            unknown = ctx == getattr(tok, "unk_token_id", None) and context_token != getattr(
                tok, "unk_token", None
            )
            if ctx is None or unknown:
                raise ValueError(f"context token {context_token!r} is not in the tokenizer's vocabulary")
        else:
            ctx = tok.bos_token_id if tok.bos_token_id is not None else eos
        return [ctx], eos
    raise ValueError(f"arch must be 'encoder' or 'decoder', got {arch!r}")


@torch.inference_mode()
def extract_states(
    model: nn.Module,
    tok,
    texts: Sequence[str],
    arch: str,
    layers: Sequence[int] = (-1,),
    batch_size: int = 128,
    max_pieces: int | None = None,
    on_truncate: str = "error",
    bypass_final_norm: bool = True,
    context_token: str | None = None,
    progress: Callable[[Iterable, int, str], Iterable] | None = None,
    device: torch.device | str = "cpu",
    pool: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> TokenStates:
    """Run ``model`` over ``texts`` in length-sorted batches and keep the selected layers' states.

    Args:
        model: an HF encoder (``AutoModel``) or causal LM (``AutoModelForCausalLM``).
        tok: its tokenizer.
        texts: words or texts, each encoded on its own.
        arch: "encoder" or "decoder".
        layers: hidden-state indices (0 = embeddings output, −1 = last block).
        batch_size: items per forward pass; ``1`` is the naive per-item loop.
        max_pieces: cut each text to this many pieces; ``None``/0 = all the model accepts
            (:func:`context_limit`); a larger value is capped there.
        on_truncate: ``"error"`` raises :class:`TruncationError` when any item is longer than the limit;
            ``"warn"`` cuts it and warns with the counts.
        bypass_final_norm: decoders only; read the last block's state before the final norm.
        context_token: decoders only; the token before the text (default BOS, else EOS).
        progress: ``run.progress``-like wrapper ``(iterable, total, desc)``.
        device: where to run.
        pool: encoders only; ``(token_states (b, pos, d_model), attention_mask (b, pos)) -> (b, d_pooled)``
            over the whole sequence, specials included, applied to every selected layer (e.g.
            ``SentencePipeline.pool``); None = the CLS state.

    Returns:
        :class:`TokenStates` in the order of ``texts``.
    """
    if not texts:
        raise ValueError("extract_states: no texts given")
    sel = resolve_layers(model, layers)
    n_total = n_layers_of(model)
    if on_truncate not in ("error", "warn"):
        raise ValueError(f"on_truncate must be 'error' or 'warn', got {on_truncate!r}")
    ctx_limit = context_limit(model, tok)
    limit = min(max_pieces, ctx_limit) if max_pieces else ctx_limit
    full = piece_ids(tok, texts, arch)
    n_full = torch.tensor([len(p) for p in full], dtype=torch.long)
    over = n_full > limit
    if over.any():
        what = "the model's context" if limit == ctx_limit else f"max_pieces={limit}"
        msg = (f"{int(over.sum())} of {len(texts)} texts have more pieces than {what} allows ({limit}); "
               f"longest {int(n_full.max())} pieces, {int((n_full - limit).clamp_min(0).sum())} pieces cut")  # fmt: skip
        if on_truncate == "error":
            raise TruncationError(msg + "; raise max_pieces (0 = the model's context) or shorten the texts")
        log.warning("TRUNCATED: %s", msg)
        warnings.warn(f"TRUNCATED: {msg}", stacklevel=2)
    pieces = [p[:limit] for p in full]
    pre, post = _special_ids(tok, arch, context_token)
    n, pos = len(texts), max(len(p) for p in pieces)
    d_model = model.get_input_embeddings().weight.shape[1]
    if pool is not None and arch != "encoder":
        raise ValueError("a pool function applies to encoders only (decoders pool the appended EOS state)")
    states = torch.zeros(n, len(sel), pos, d_model)
    pooled: Tensor | None = None if pool is not None else torch.zeros(n, len(sel), d_model)
    mask = torch.zeros(n, pos, dtype=torch.bool)
    ids_out = torch.full((n, pos), -1, dtype=torch.long)
    surprisal = torch.zeros(n, pos) if arch == "decoder" else None

    captured: dict[str, Tensor] = {}
    hook = None
    norm = final_norm(model) if (arch == "decoder" and bypass_final_norm) else None
    if norm is not None and n_total in sel:
        hook = norm.register_forward_hook(lambda _m, inp, _o: captured.__setitem__("pre_norm", inp[0]))
    order = sorted(range(n), key=lambda i: len(pieces[i]))  # length-sorted batches waste little padding
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    it = progress(batches, len(batches), f"{arch} states") if progress else batches
    pad_id = 0 if tok.pad_token_id is None else tok.pad_token_id
    try:
        for batch in it:
            seqs = [pre + pieces[i] + [post] for i in batch]
            width = max(len(s) for s in seqs)
            input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            attn = torch.zeros(len(seqs), width, dtype=torch.long)
            for r, s in enumerate(seqs):  # right padding: causal and absolute-position models both accept it
                input_ids[r, : len(s)] = torch.tensor(s)
                attn[r, : len(s)] = 1
            out = model(
                input_ids=input_ids.to(device), attention_mask=attn.to(device), output_hidden_states=True
            )
            hidden = list(out.hidden_states)
            if hook is not None:
                hidden[n_total] = captured.pop("pre_norm")
            stack = (
                torch.stack([hidden[layer] for layer in sel], 1).float().cpu()
            )  # [b, n_sel, width, d_model]
            logp = out.logits.float().log_softmax(-1).cpu() if arch == "decoder" else None
            own = None
            if pool is not None:  # [b, n_sel, d_pooled]: the pipeline's modules on each selected layer
                own = torch.stack([pool(stack[:, k], attn) for k in range(len(sel))], 1).float()
                if pooled is None:
                    pooled = torch.zeros(n, len(sel), own.shape[-1])
            for r, i in enumerate(batch):
                k = len(pieces[i])
                start = len(pre)
                states[i, :, :k] = stack[r, :, start : start + k]
                if own is not None:
                    pooled[i] = own[r]
                elif arch == "encoder":
                    pooled[i] = stack[r, :, 0]  # CLS
                else:
                    pooled[i] = stack[r, :, start + k]  # the appended EOS
                mask[i, :k] = True
                ids_out[i, :k] = torch.tensor(pieces[i])
                if logp is not None:
                    # logits at position j predict token j+1
                    tgt = torch.tensor(pieces[i])
                    surprisal[i, :k] = -logp[r, start - 1 : start - 1 + k].gather(1, tgt[:, None])[:, 0]
    finally:
        if hook is not None:
            hook.remove()
    return TokenStates(states, pooled, mask, ids_out, sel, surprisal, n_full, limit)


def input_table_states(model: nn.Module, piece_ids: Tensor) -> Tensor:
    """Rows of the model's input embedding table for padded ``piece_ids`` ``(n, pos)`` → ``(n, pos, d_model)``.

    Padding ids (−1) give zero rows. No position embeddings or LayerNorm: this is the static table.
    """
    table = model.get_input_embeddings().weight.detach().float().cpu()
    safe = piece_ids.clamp_min(0)
    return table[safe] * (piece_ids >= 0).unsqueeze(-1)
