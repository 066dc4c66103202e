"""Find decoder blocks and parse layer specs generically, for any Hugging Face causal LM [ours].

The official CRL attack code hard-codes ``model.model.layers`` (Llama/Mistral). We instead look for the
``nn.ModuleList`` whose length equals the config's number of hidden layers and that holds the most
parameters, which finds ``model.layers`` (Llama, Mistral, Qwen), ``transformer.h`` (GPT-2) or
``gpt_neox.layers`` alike, with or without a peft wrapper around the model.

Layer indices everywhere in this package follow ``output_hidden_states``: index 0 is the embedding
output and index ``i`` (1..n_layers) is the output of decoder block ``i - 1``.
"""

from __future__ import annotations

import math

from torch import nn


def num_layers(model: nn.Module) -> int:
    """Number of decoder blocks from the model's (text) config."""
    cfg = model.config
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(cfg, key, None) is not None:
            return int(getattr(cfg, key))
    raise ValueError(f"cannot read the number of layers from config {type(cfg).__name__}")


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """Return ``(qualified name, ModuleList)`` of the decoder blocks.

    Raises:
        ValueError: when no ModuleList of the config's length exists.
    """
    n = num_layers(model)
    candidates = [
        (name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) == n
    ]
    if not candidates:
        raise ValueError(f"no nn.ModuleList of length {n} (num_hidden_layers) in {type(model).__name__}")
    # several lists of length n can exist (e.g. per-layer norms); the blocks hold the most parameters
    return max(candidates, key=lambda c: sum(p.numel() for p in c[1].parameters()))


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """Parse a hidden-state layer spec into sorted indices in ``[0, n_layers]``.

    Accepted forms: ``"a:b"`` (inclusive range; negative numbers count from ``n_layers``, so ``-2`` is
    ``n_layers - 2``), ``"a,b,c"``, ``"third:-2"`` (``third`` = ``ceil(n_layers / 3)``, our
    ⌈L/3⌉..L−2 default [ours]), ``"all"`` (0..n_layers).
    """
    spec = spec.strip()

    def one(tok: str) -> int:
        tok = tok.strip()
        if tok == "third":
            return math.ceil(n_layers / 3)
        if tok == "two_thirds":
            return (2 * n_layers) // 3
        i = int(tok)
        return n_layers + i if i < 0 else i

    if spec == "all":
        out = list(range(n_layers + 1))
    elif ":" in spec:
        lo, hi = spec.split(":")
        out = list(range(one(lo), one(hi) + 1))
    else:
        out = [one(t) for t in spec.split(",") if t.strip()]
    out = sorted(set(out))
    if not out or out[0] < 0 or out[-1] > n_layers:
        raise ValueError(f"layer spec {spec!r} gives {out}, outside 0..{n_layers}")
    return out
