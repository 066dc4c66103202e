"""The model a Reason-to-Rote recipe trains when ``model.hf_id`` is set: a Hugging Face causal LM.

Without ``model.hf_id`` the recipes build our GPT (``reprlab.models.gpt``) exactly as before. With it they
fine-tune the named causal LM (hub id, local folder or packaged alias such as ``smollm2-135m-instruct``), or
train its architecture from scratch (``model.from_config=true``: random init from its ``config.json``), on
the same noisy FDA/THR items, behind :class:`~reprlab.models.hf_lm.HFCausalLM`; every analysis then reads
hook names through :mod:`reprlab.hooks.sites`.

Tokenisation [ours] (``model.tokens``). The tasks are sequences of task tokens (FDA: characters ``0-9 + =``;
THR: words); what the model sees is one model token per task token, so every position, answer index and
probe cell means the same as for our GPT:

* ``tokenizer``: each task token is encoded *alone* by the model's tokenizer and must give exactly one id
  (FDA characters; THR words with a leading space, as they stand after the first word of a sentence);
  ``<eos>`` is the tokenizer's EOS and ``<pad>`` its pad token (EOS when it has none). A THR word that is not
  one token becomes a new token (the embedding grows, new rows at the mean of the old ones: HF's
  ``resize_token_embeddings``). For tokenizers that split digits individually (SmolLM2, Llama-2, Qwen2) this
  is the tokenizer's own encoding of ``1234+5678=21960`` (tested for SmolLM2); for GPT-2's BPE, which merges
  digit runs, it is not, and the prompt is spelled digit by digit instead.
* ``task``: the task vocabulary's ids are the model's ids (a model trained from its config gets
  ``vocab_size`` = the task vocabulary; a pretrained model must have at least that many rows, e.g. a GPT-2
  converted from our GPT by :func:`reprlab.models.gpt.to_hf_gpt2`).
* ``auto`` (default): ``task`` with ``from_config``, else ``tokenizer``.

Dropout is set to 0 in every module [ours, as for our GPT]: it suppresses memorisation, the object of study.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from reprlab.errors import ConfigError
from reprlab.methods.reason_to_rote.dataset import Batch, Vocab
from reprlab.models.hf_lm import HFCausalLM

TOKEN_MODES = ("auto", "tokenizer", "task")


@dataclass(frozen=True)
class HFOptions:
    """Which Hugging Face causal LM to train instead of our GPT (the GPT sizes then do not apply)."""

    hf_id: str = field(default="", metadata={
        "help": "HF causal LM to train instead of our GPT: hub id, local folder or packaged alias "
                "(smollm2-135m-instruct); '' = our GPT with the sizes below"})  # fmt: skip
    from_config: bool = field(
        default=False,
        metadata={"help": "train hf_id's architecture from scratch (random init from its config) instead "
                          "of fine-tuning its pretrained weights"},
    )  # fmt: skip
    tokens: str = field(default="auto", metadata={
        "help": "how task tokens become model ids: tokenizer (each task token encoded alone by the model's "
                "tokenizer), task (the task vocabulary's ids), auto (task with from_config, else tokenizer)",
        "choices": list(TOKEN_MODES)})  # fmt: skip


@dataclass
class LM:
    """A built HF model and what the recipe needs around it.

    Attributes:
        model: the wrapped model to train (:class:`HFCausalLM`).
        token_map: (len(vocab),) model id of each task token.
        fresh: builds the same model again before training (pretrained weights or the same random init).
        untrained: builds the untrained control of the probes (random init from the same config).
        info: what was built, for ``analysis/model.json``.
        tokenizer: the model's tokenizer (None for ``tokens=task`` without one).
    """

    model: HFCausalLM
    token_map: Tensor
    fresh: Callable[[], HFCausalLM]
    untrained: Callable[[], HFCausalLM]
    info: dict
    tokenizer: object | None = None

    def remap(self, batch: Batch) -> Batch:
        """A batch in model ids (positions and spans unchanged)."""
        return Batch(self.token_map[batch.ids], self.token_map[batch.ids_true], batch.answer_start,
                     batch.answer_len, batch.noisy)  # fmt: skip


def _no_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):  # Llama-style functional dropout
            m.attention_dropout = 0.0


def _drop_gguf_marker(hf: nn.Module) -> None:
    """A GGUF checkpoint is dequantised to plain float tensors on load, but the model keeps a GGUF
    "quantizer" that makes ``save_pretrained`` refuse it; drop the marker so the trained weights can be saved
    (and loaded again without the GGUF file)."""
    if type(getattr(hf, "hf_quantizer", None)).__name__ == "GgufHfQuantizer":
        hf.hf_quantizer = None
        if getattr(hf.config, "quantization_config", None) is not None:
            del hf.config.quantization_config


def _load_tokenizer(path: str, kwargs: dict, required: bool, hf_id: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, TypeError) as err:
        if required:
            raise ConfigError(f"model.hf_id={hf_id!r}: no tokenizer could be loaded ({err})",
                              "set model.tokens=task to use the task vocabulary's ids") from err  # fmt: skip
        return None


def _tokens_mode(tokens: str, from_config: bool) -> str:
    """``model.tokens`` resolved: ``auto`` is ``task`` for a model built from its config, else ``tokenizer``."""
    if tokens not in TOKEN_MODES:
        raise ConfigError(f"model.tokens={tokens!r} is not one of {list(TOKEN_MODES)}")
    return ("task" if from_config else "tokenizer") if tokens == "auto" else tokens


def _check_positions(config, hf_id: str, n_ctx: int) -> None:
    n_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if n_pos is not None and n_pos < n_ctx:
        raise ConfigError(f"model.hf_id={hf_id!r} takes {n_pos} positions, the task needs {n_ctx}")


def check_hf_model(hf_id: str, from_config: bool, tokens: str):
    """Preflight of ``model.hf_id`` (FDA and THR alike): available offline, a config that loads, and a folder
    with weights (unless built from its config) and a working tokenizer where the task tokens go through it
    (a folder with a config and weights but no tokenizer files fails here, not after training starts).

    Raises:
        ModelNotAvailableError, ConfigError: naming ``model.hf_id`` and what is missing.

    Returns:
        the model's transformers config (None for a GGUF file, read only by its loader), for :func:`plan_lm`.
    """
    from reprlab.models.hf import preflight_model

    needs_tokenizer = _tokens_mode(tokens, from_config) == "tokenizer"
    return preflight_model(hf_id, "model.hf_id", weights=not from_config, tokenizer=needs_tokenizer)


def plan_lm(hf_id: str, from_config: bool, tokens: str, vocab: Vocab, n_ctx: int, config) -> int | None:
    """Every check of :func:`build_lm` that needs no weights, for the recipes' preflight, on ``config`` (what
    :func:`check_hf_model` returned): the config's positions, the token map (each task token one id of the
    tokenizer, inside the model's embedding), and a layout the hook sites read, on a weightless (meta-device) copy
    of the architecture. Returns the model's number of blocks; None for a GGUF file (no config without parsing
    it: :func:`build_lm` checks it when it loads).

    Raises:
        ConfigError: naming ``model.hf_id`` and what does not fit.
    """
    from transformers import AutoModelForCausalLM

    from reprlab.hooks.sites import n_layers
    from reprlab.models.hf import _resolve

    if config is None:
        return None
    mode = _tokens_mode(tokens, from_config)
    _check_positions(config, hf_id, n_ctx)
    # the architecture first: a model of the wrong kind (BERT loads as BertLMHeadModel) makes every later
    # message beside the point (its tokenizer has no EOS, say)
    try:
        with torch.device("meta"):
            depth = n_layers(AutoModelForCausalLM.from_config(config))
    except (
        TypeError,
        ValueError,
    ) as err:  # no causal-LM class for it, or a layout the hook sites cannot read
        raise ConfigError(f"model.hf_id={hf_id!r} ({type(config).__name__}) is not a causal LM reprlab can "
                          f"hook: {err}", "use a decoder-only causal LM (GPT-2, Llama, Mistral, Qwen style)") from err  # fmt: skip
    path, kwargs = _resolve(hf_id)
    tokenizer = _load_tokenizer(path, kwargs, mode == "tokenizer", hf_id)
    token_map(
        vocab, tokenizer, mode, len(vocab) if from_config and mode == "task" else int(config.vocab_size)
    )
    return depth


def preflight_lm(model_cfg, ds) -> int | None:
    """A recipe's preflight of ``model.hf_id`` on the run's own data ``ds`` (generated, deterministic):
    :func:`check_hf_model`, then :func:`plan_lm` on its config. Returns the model's depth (None for a GGUF)."""
    from reprlab.methods.reason_to_rote.dataset import tensorize

    config = check_hf_model(model_cfg.hf_id, model_cfg.from_config, model_cfg.tokens)
    vocab = Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"])
    n_ctx = tensorize(ds.splits["train"], vocab).ids.shape[1]
    return plan_lm(model_cfg.hf_id, model_cfg.from_config, model_cfg.tokens, vocab, n_ctx, config)


def token_map(vocab: Vocab, tokenizer, mode: str, vocab_size: int) -> tuple[list[int], list[str]]:
    """Model id of every task token, and the task tokens that need a new embedding row (module docstring).

    Args:
        vocab: the task vocabulary.
        tokenizer: the model's tokenizer (``mode="tokenizer"`` only).
        mode: ``tokenizer`` or ``task``.
        vocab_size: rows of the model's embedding before any new token.

    Returns:
        ``(ids, new_tokens)``: ``ids[i]`` is the model id of ``vocab.tokens[i]``; new tokens get ids
        ``vocab_size, vocab_size + 1, ...`` in the order listed.
    """
    if mode == "task":
        if len(vocab) > vocab_size:
            raise ConfigError(f"model.tokens=task needs at least {len(vocab)} embedding rows (the task "
                              f"vocabulary), the model has {vocab_size}", "use model.tokens=tokenizer")  # fmt: skip
        return list(range(len(vocab))), []
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("model.tokens=tokenizer: the tokenizer has no EOS token", "use model.tokens=task")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids, new = [], []

    def inside(tok: str, i: int) -> int:
        if (
            not 0 <= i < vocab_size
        ):  # the tokenizer is not this model's: the id would index past the embedding
            raise ConfigError(f"model.tokens=tokenizer: the tokenizer gives {tok!r} the id {i}, but the model "
                              f"has {vocab_size} embedding rows: its tokenizer and config do not belong together",
                              "give a folder whose tokenizer matches its config.json vocab_size, or use "
                              "model.tokens=task")  # fmt: skip
        return i

    for tok in vocab.tokens:
        if tok in ("<eos>", "<pad>"):
            ids.append(inside(tok, eos if tok == "<eos>" else pad))
            continue
        enc = tokenizer.encode(tok if vocab.tokenizer == "char" else " " + tok, add_special_tokens=False)
        if len(enc) == 1:
            ids.append(inside(tok, int(enc[0])))
        elif vocab.tokenizer == "char":
            raise ConfigError(f"model.tokens=tokenizer: the tokenizer splits the task character {tok!r} into "
                              f"{len(enc)} tokens {enc}", "use model.tokens=task (and model.from_config=true)")  # fmt: skip
        else:
            ids.append(vocab_size + len(new))
            new.append(tok)
    return ids, new


def build_lm(hf_id: str, from_config: bool, tokens: str, vocab: Vocab, n_ctx: int, seed: int,
             device: str | torch.device = "cpu") -> LM:  # fmt: skip
    """Load or initialise the HF causal LM ``hf_id`` for a task with ``vocab`` and sequences of ``n_ctx``.

    Raises:
        ConfigError: unknown tokens mode, a task token the tokenizer cannot give one id, too short a context.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from reprlab.models.hf import _resolve

    mode = _tokens_mode(tokens, from_config)
    path, kwargs = _resolve(hf_id)
    tokenizer = _load_tokenizer(path, kwargs, mode == "tokenizer", hf_id)

    def load() -> nn.Module:  # the pretrained model (its config comes with it: a GGUF is parsed once)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)

    if from_config:
        config = AutoConfig.from_pretrained(path, **kwargs)
        if mode == "task":
            config.vocab_size = len(vocab)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if getattr(config, key, None) is not None:
                    setattr(config, key, vocab.eos if key != "pad_token_id" else vocab.pad)
        torch.manual_seed(seed)
        first = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        torch.manual_seed(seed)
        first = load()
        config = first.config
    _check_positions(config, hf_id, n_ctx)
    base_vocab = int(config.vocab_size)
    ids, new = token_map(vocab, tokenizer, mode, base_vocab)

    def finish(hf: nn.Module) -> HFCausalLM:
        _drop_gguf_marker(hf)
        if new and hf.get_input_embeddings().weight.shape[0] < base_vocab + len(new):
            hf.resize_token_embeddings(base_vocab + len(new))
        hf.config.use_cache = False
        _no_dropout(hf)
        return HFCausalLM(hf).to(device).eval()

    def fresh() -> HFCausalLM:
        torch.manual_seed(seed)
        return finish(
            AutoModelForCausalLM.from_config(config, dtype=torch.float32) if from_config else load()
        )

    def untrained() -> HFCausalLM:
        torch.manual_seed(seed + 1)
        return finish(AutoModelForCausalLM.from_config(config, dtype=torch.float32))

    model = finish(first)
    info = {
        "hf_id": hf_id, "from_config": from_config, "tokens": mode, "architecture": type(model.hf_model).__name__,
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_layers": int(config.num_hidden_layers), "d_model": int(config.hidden_size),
        "n_heads": int(config.num_attention_heads), "token_ids": dict(zip(vocab.tokens, ids)), "new_tokens": new,
    }  # fmt: skip
    return LM(model, torch.tensor(ids), fresh, untrained, info, tokenizer)


def save_lm(lm: LM, folder) -> dict:
    """Write the trained model where ``transformers`` loads it: ``save_pretrained`` weights and config, the
    tokenizer when the model reads its ids (``model.tokens=tokenizer`` and no task word given a new row; with the
    task vocabulary's ids, or new rows, the source folder's tokenizer would not match the model), and
    ``task_tokens.json`` (the model id of each task token)."""
    import json
    from pathlib import Path

    folder = Path(folder)
    lm.model.hf_model.save_pretrained(folder)
    # words given new embedding rows are not in the tokenizer, which would split them into its own pieces
    if lm.tokenizer is not None and lm.info.get("tokens") == "tokenizer" and not lm.info.get("new_tokens"):
        lm.tokenizer.save_pretrained(folder)
    (folder / "task_tokens.json").write_text(json.dumps(lm.info["token_ids"], indent=1))
    return {"folder": folder.name, "files": sorted(p.name for p in folder.iterdir())}
