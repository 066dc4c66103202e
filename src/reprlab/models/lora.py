"""LoRA on any Hugging Face causal LM through peft, restricted to chosen decoder blocks.

``add_lora`` finds the decoder-block list generically (``methods.crl_safety.layers`` logic, duplicated in
a few lines here so models/ does not import a method) and passes peft ``layers_to_transform`` with the list's
attribute name as ``layers_pattern``. ``AdapterParams`` exposes only the trainable adapter tensors as an
``nn.Module`` so ``Run.save_checkpoint`` stores megabytes, not the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def _block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    cands = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not cands:
        raise ValueError(f"no decoder-block ModuleList of length {n} in {type(model).__name__}")
    return max(cands, key=lambda c: sum(p.numel() for p in c[1].parameters()))


def add_lora(model: nn.Module, r: int = 16, alpha: int = 16, dropout: float = 0.05,
             target_modules: str | Sequence[str] = "all-linear", blocks: Sequence[int] | None = None,
             adapter_name: str = "default"):  # fmt: skip
    """Wrap ``model`` with a fresh LoRA adapter (B = 0, so outputs are unchanged at init).

    Args:
        target_modules: peft's ``"all-linear"`` (every linear layer but the output head: the 7 projections on
            Llama/Mistral) or a list of module names.
        blocks: decoder-block indices (0-based) that get adapters; None = all.

    Returns:
        the ``peft.PeftModel``.
    """
    from peft import LoraConfig, get_peft_model

    kwargs = {}
    if blocks is not None:
        kwargs = {"layers_to_transform": sorted(int(b) for b in blocks),
                  "layers_pattern": _block_list(model)[0].split(".")[-1]}  # fmt: skip
    tm = target_modules if isinstance(target_modules, str) else list(target_modules)
    if tm == "all-linear" and blocks is not None:
        # peft refuses layers_to_transform with a string target; name the blocks' linear layers instead
        _, block_list = _block_list(model)
        tm = sorted({n.split(".")[-1] for n, m in block_list[0].named_modules() if isinstance(m, nn.Linear)})
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=tm, bias="none",
                     task_type="CAUSAL_LM", **kwargs)  # fmt: skip
    return get_peft_model(model, cfg, adapter_name=adapter_name)


class AdapterParams(nn.Module):
    """The trainable parameters of a model as one module (shared tensors, not copies).

    ``load_state_dict`` on it therefore writes into the live adapter weights.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.register_parameter(name.replace(".", "__"), p)
        if not list(self.parameters()):
            raise ValueError("model has no trainable parameters to checkpoint")
