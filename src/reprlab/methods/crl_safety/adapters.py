"""LoRA adapters of a live CRL model written as peft folders (``adapter_config.json`` +
``adapter_model.safetensors``), one per trained stage; ``export.py`` reads run folders back and merges.

A defence's adapter is stacked on stage 0's (see ``export.py`` for the algebra).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from reprlab.runs.atomic import publish_dir, temp_sibling_dir

log = logging.getLogger(__name__)


@dataclass
class LoraPart:
    """One stage's LoRA: per adapted module (path inside the base model), ``A`` and the scaled ``s B``.

    Attributes:
        modules: ``{path: (A [r, d_in], sB [d_out, r])}``, float32 on the CPU.
        dropout: the stage's LoRA dropout (kept in the exported config for further training).
    """

    modules: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    dropout: float = 0.0

    def is_zero(self) -> bool:
        return all(not bool(sb.any()) for _, sb in self.modules.values())


def _full(t: Tensor) -> Tensor:
    # FSDP2 shards the adapters as DTensors; every rank runs this, so the gather is collective
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def lora_part(peft_model, adapter_name: str) -> LoraPart:
    """The adapter ``adapter_name`` of a live ``PeftModel`` with peft's own per-module scaling folded in.

    Raises:
        ValueError: the adapter uses a LoRA variant this export does not map (DoRA, fan_in_fan_out, bias).
    """
    from peft.tuners.lora import LoraLayer

    cfg = peft_model.peft_config[adapter_name]
    if (
        getattr(cfg, "use_dora", False)
        or getattr(cfg, "fan_in_fan_out", False)
        or getattr(cfg, "lora_bias", False)
    ):
        raise ValueError(f"adapter {adapter_name!r}: DoRA, fan_in_fan_out and LoRA biases are not exported")
    part = LoraPart(dropout=float(cfg.lora_dropout))
    prefix = "base_model.model."
    for name, mod in peft_model.named_modules():
        if isinstance(mod, LoraLayer) and adapter_name in mod.lora_A:
            a = _full(mod.lora_A[adapter_name].weight).detach().float().cpu().clone()
            b = _full(mod.lora_B[adapter_name].weight).detach().float().cpu()
            path = name[len(prefix) :] if name.startswith(prefix) else name
            part.modules[path] = (a, b * float(mod.scaling[adapter_name]))
    if not part.modules:
        raise ValueError(f"the model has no LoRA adapter named {adapter_name!r}")
    return part


def stack(parts: list[LoraPart]) -> tuple[dict, dict[str, Tensor]]:
    """One LoRA equal to the sum of ``parts``: ``(adapter_config dict fields, peft state dict)``.

    The rank is the sum of the parts' ranks; a module a part does not adapt gets zero rows there.
    """
    parts = [p for p in parts if not p.is_zero()] or parts[-1:]
    paths = sorted({m for p in parts for m in p.modules})
    ranks = [next(iter(p.modules.values()))[0].shape[0] for p in parts]
    r = sum(ranks)
    state = {}
    for path in paths:
        a_rows, b_cols = [], []
        for p, rank in zip(parts, ranks):
            if path in p.modules:
                a, sb = p.modules[path]
            else:  # shapes from any part that adapts this module
                a0, sb0 = next(q.modules[path] for q in parts if path in q.modules)
                a, sb = a0.new_zeros(rank, a0.shape[1]), sb0.new_zeros(sb0.shape[0], rank)
            a_rows.append(a)
            b_cols.append(sb)
        key = f"base_model.model.{path}"
        state[f"{key}.lora_A.weight"] = torch.cat(a_rows, 0).contiguous()
        state[f"{key}.lora_B.weight"] = torch.cat(b_cols, 1).contiguous()
    config = {"r": r, "lora_alpha": r, "target_modules": paths, "lora_dropout": parts[-1].dropout}
    return config, state


def base_reference(base_id: str) -> str:
    """What an adapter records as its base: a local folder as an absolute path (a relative one would resolve
    against whatever directory loads the adapter), anything else (a hub id, a packaged alias) as given."""
    path = Path(base_id).expanduser()
    return str(path.resolve()) if path.is_dir() else base_id


def lora_config(fields: dict, base_id: str):
    """peft ``LoraConfig`` of a stacked adapter (scaling 1: the scales are folded into B)."""
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", bias="none", base_model_name_or_path=base_id, inference_mode=True,
                      **fields)  # fmt: skip


def write_adapter(
    out: Path, parts: list[LoraPart], base_id: str, note: str = "", replace: bool = True
) -> Path:
    """Write ``parts`` stacked as one peft adapter folder (atomically: a finished folder or none); ``replace``:
    see :func:`~reprlab.runs.atomic.publish_dir` (off for a user's export folder)."""
    from safetensors.torch import save_file

    fields, state = stack(parts)
    base_id = base_reference(base_id)
    tmp = temp_sibling_dir(out)
    try:
        lora_config(fields, base_id).save_pretrained(str(tmp))
        _sort_target_modules(tmp / "adapter_config.json")
        save_file(state, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(_readme(base_id, fields["r"], note), encoding="utf-8")
        return publish_dir(tmp, out, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sort_target_modules(path: Path) -> None:
    """peft keeps ``target_modules`` as a set and writes it in hash order, which changes from process to process
    (string hashing is salted): sorted, one adapter's config is the same file whoever writes it."""
    import json

    conf = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(conf.get("target_modules"), list):
        conf["target_modules"] = sorted(conf["target_modules"])
        path.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _readme(base_id: str, r: int, note: str) -> str:
    from reprlab.models.hf import PACKAGED_MODELS

    load = f'base = AutoModelForCausalLM.from_pretrained("{base_id}")'
    extra = ""
    if base_id.lower() in PACKAGED_MODELS:
        load = f'base, tok = load_causal_lm("{base_id}")  # from reprlab.models.hf'
        if base_id.lower() == "smollm2-135m-instruct":
            extra = ("\nOnline, `HuggingFaceTB/SmolLM2-135M-Instruct` is the same architecture, but reprlab trained on "
                     "the packaged Q4_1 GGUF weights dequantised to fp32, which differ from the original fp weights, "
                     "so the adapter's effect there is close, not identical.\n")  # fmt: skip
    return (f"# LoRA adapter exported by reprlab\n\n{note}\n\nRank {r}, scaling 1 (the training scalings are folded "
            f"into lora_B).\n\n```python\nfrom peft import PeftModel\n{load}\nmodel = PeftModel.from_pretrained(base, "
            f"\"<this folder>\")\n```\n{extra}")  # fmt: skip


def save_stage_adapter(run, stage: str, parts: list[LoraPart], base_id: str) -> Path | None:
    """The run's own copy of a trained stage: ``<run>/adapters/<stage>/`` (main rank only)."""
    if not getattr(run, "is_main", True):
        return None
    note = f"Stage `{stage}` of the CRL run in `{run.dir}`."
    return write_adapter(Path(run.dir) / "adapters" / stage, parts, base_id, note)


# ---------------------------------------------------------------------------------------------- run folder
