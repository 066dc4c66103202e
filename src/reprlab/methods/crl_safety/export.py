"""CRL models in the formats peft, transformers and inference servers load: LoRA adapter folders, merged models.

A CRL run trains LoRA adapters with peft (``models/lora.py``): stage 0 (``refusal``) on the base model, then
each defence (``rr``, ``crl``, ``crl_adv``) as a fresh LoRA on the base with stage 0 merged in. A defence's
adapter alone therefore means nothing on the base model. Its export stacks both [ours, exact]:

    W x + s0 B0 A0 x + s1 B1 A1 x  =  W x + [s0 B0 | s1 B1] [A0 ; A1] x

one LoRA of rank r0 + r1 with the scalings folded into B (``lora_alpha = r``, so peft's scaling is 1), on every
module either stage adapted (zero rows where one stage has no adapter). It loads with
``PeftModel.from_pretrained(base, folder)`` on the base model the run started from. Stage 0 of the GPU
recipes trains 0 steps (the instruct model refuses already): its adapter is zero and is left out.

Formats (``reprlab export RUN_DIR --stage S --adapter DIR | --merged DIR``):

* ``adapter``: ``adapter_config.json`` + ``adapter_model.safetensors`` (peft's ``save_pretrained`` layout);
  the run writes the same folder for every stage it trains under ``adapters/<stage>/``.
* ``merged``: the base with the adapter merged into its weights, ``config.json``, safetensors weights and
  the tokenizer with its chat template; loads with ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained``. A GGUF base (the packaged SmolLM2) is written as a plain fp model: its
  ``quantization_config`` is dropped (``docs/assets.md``, SmolLM2), the weights are the dequantised ones.

Weights come from the run folder's checkpoints through ``reprlab.runs.checkpoint``'s loading functions.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from reprlab.jsonfile import dumps_json
from reprlab.methods.crl_safety.adapters import (  # re-exported: the export API
    LoraPart,
    lora_config,
    lora_part,
    stack,
    write_adapter,
)
from reprlab.runs.atomic import publish_dir, temp_sibling_dir

log = logging.getLogger(__name__)
STAGES = ("refusal", "rr", "crl", "crl_adv")
FORMATS = ("adapter", "merged")  # reprlab.export: each a CLI option --<format> OUT
_TAG = {"refusal": "sft", "rr": "rr", "crl": "crl", "crl_adv": "crl_adv"}  # stage -> checkpoint tag


def _run_config(run_dir: Path):
    """The run's config, its ``model`` made absolute where it is a folder given relative to the directory the
    run was started in (``env.json``'s ``cwd``): an export from another directory loads the same base."""
    import dataclasses

    import yaml

    from reprlab.config import load_config
    from reprlab.methods.crl_safety.recipe import Config
    from reprlab.runs.atomic import read_json

    cfg = load_config(Config, yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")))
    model = Path(cfg.model).expanduser()
    env = run_dir / "env.json"
    if not model.is_absolute() and not model.is_dir() and env.exists():
        started_in = read_json(env).get("cwd")
        if started_in and (Path(started_in) / model).is_dir():
            cfg = dataclasses.replace(cfg, model=str((Path(started_in) / model).resolve()))
    return cfg


def _stage_lora(cfg, kind: str, n_layers: int):
    """``(LoraCfg, blocks)`` of a stage, as the recipe builds it."""
    from reprlab.methods.crl_safety.trainer import lora_blocks

    if kind == "refusal":
        lc = cfg.sft.lora
        return lc, None if lc.blocks == "auto" else lora_blocks(lc.blocks, "sft", cfg.sft, n_layers)
    return cfg.defense.lora, lora_blocks(cfg.defense.lora.blocks, kind, cfg.defense, n_layers)


def _load_stage_weights(run_dir: Path, peft_model, stage: str) -> int:
    """Load the newest intact checkpoint of ``stage`` into the live adapter; returns its step."""
    from reprlab.errors import RunFolderError
    from reprlab.models.lora import AdapterParams
    from reprlab.runs.checkpoint import list_checkpoints, load_checkpoint_dir, verify_checkpoint

    tag_dir = run_dir / "checkpoints" / _TAG[stage]
    for ckpt in reversed(list_checkpoints(tag_dir)):
        why = verify_checkpoint(ckpt)
        if why is None:
            step, _ = load_checkpoint_dir(ckpt, {"lora": AdapterParams(peft_model)}, restore_rng=False)
            return step
        log.warning("checkpoint %s is corrupt (%s); trying the one before", ckpt, why)
    raise RunFolderError(f"{run_dir}: no intact checkpoint of stage {stage!r} under {tag_dir}",
                         "re-run the stage with `reprlab run ... --resume`")  # fmt: skip


def check_stage(run_dir: Path, stage: str) -> None:
    """Raise unless ``run_dir`` is a CRL run whose ``stage`` finished training."""
    from reprlab.errors import ConfigError, RunFolderError

    if stage not in STAGES:
        raise ConfigError(f"unknown CRL stage {stage!r}; valid stages: {', '.join(STAGES)}")
    done = run_dir / "stages" / f"train_{stage}.json"
    if not done.exists():
        cfg = _run_config(run_dir)
        trained = [s for s in STAGES if (run_dir / "stages" / f"train_{s}.json").exists()]
        raise RunFolderError(
            f"run folder {run_dir} has no finished {stage!r} stage ({done.relative_to(run_dir)} is missing; the "
            f"run's models: {', '.join(cfg.models)}; trained: {', '.join(trained) or 'none'})",
            "export a trained stage, or finish the run with `reprlab run ... --resume`")  # fmt: skip


def load_stage(run_dir: Path, stage: str, device: str = "cpu"):
    """Rebuild a finished stage from the run folder: ``(base model, tokenizer, parts, cfg)``.

    ``parts`` are the LoRA parts to stack on the base (stage 0, then the defence); the base comes back
    without adapters.
    """
    from reprlab.methods.crl_safety.layers import num_layers
    from reprlab.methods.crl_safety.recipe import load_model
    from reprlab.models.lora import add_lora

    run_dir = Path(run_dir)
    check_stage(run_dir, stage)
    cfg = _run_config(run_dir)
    base, tok = load_model(cfg, device)
    n_layers = num_layers(base)
    parts = []
    for kind in ("refusal",) if stage == "refusal" else ("refusal", stage):
        lc, blocks = _stage_lora(cfg, kind, n_layers)
        peft = add_lora(base, lc.r, lc.alpha, lc.dropout, lc.target_modules, blocks, adapter_name=kind)
        if kind == "refusal" and cfg.sft.optim.steps == 0:  # nothing trained, no checkpoint: B stays zero
            parts.append(lora_part(peft, kind))
        else:
            if not _load_selected_step(run_dir, peft, kind):
                _load_stage_weights(run_dir, peft, kind)
            parts.append(lora_part(peft, kind))
        base = peft.unload()
    return base, tok, parts, cfg


def _load_selected_step(run_dir: Path, peft, kind: str) -> bool:
    """Where ``defense.select`` chose a step of defence ``kind``, load that step's snapshot (the run's
    ``Snapshots``) and return True: the chosen step is what the run evaluated and wrote to ``adapters/<kind>/``,
    so it is what an export must give, not the last checkpoint. False where the run selected nothing."""
    from reprlab.errors import RunFolderError
    from reprlab.jsonfile import read_stage
    from reprlab.methods.crl_safety.select import Snapshots, load_adapter_tensors

    record = run_dir / "stages" / f"select_{kind}.json"
    if not record.exists():
        return False
    sel = read_stage(record)
    snaps, step = Snapshots(run_dir, kind, write=False), sel["chosen_step"]
    if not snaps.has(step):
        raise RunFolderError(f"{run_dir}: defense.select chose step {step} of {kind!r}, but its snapshot under "
                             f"{snaps.dir} is missing (run folder damaged?)")  # fmt: skip
    load_adapter_tensors(peft, snaps.tensors(step))
    log.info("%s: exporting step %d, the step defense.select chose (of %d)", kind, step, sel["last_step"])
    return True


def export(run_dir: Path, stage: str, outputs: dict[str, Path]) -> dict[str, Path]:
    """``reprlab export RUN_DIR --stage S --adapter OUT --merged OUT``: the base and adapters load once.

    Raises:
        ConfigError: ``merged`` of a run whose tokenizer is reprlab's test byte tokenizer.
    """
    from reprlab.errors import ConfigError

    run_dir = Path(run_dir)
    base, tok, parts, cfg = load_stage(run_dir, stage)
    if "merged" in outputs and not hasattr(tok, "save_pretrained"):
        raise ConfigError(f"the run's model {cfg.model!r} has reprlab's test byte tokenizer, which transformers "
                          "cannot load: a merged folder needs a Hugging Face tokenizer",
                          "export --adapter instead, or train on a model folder with its tokenizer")  # fmt: skip
    done = {}
    if "adapter" in outputs:
        note = f"Stage `{stage}` of the CRL run in `{run_dir}`."
        done["adapter"] = write_adapter(Path(outputs["adapter"]), parts, cfg.model, note, replace=False)
    if "merged" in outputs:
        merged = merge(base, parts, cfg.model)
        done["merged"] = save_merged(merged, tok, Path(outputs["merged"]), f"stage {stage} of {run_dir}")
    return done


def merge(base, parts: list[LoraPart], base_id: str = ""):
    """The base with the stacked adapter merged into its weights (peft's ``merge_and_unload``)."""
    from peft import get_peft_model, set_peft_model_state_dict

    fields, state = stack(parts)
    peft = get_peft_model(base, lora_config(fields, base_id))
    unexpected = set_peft_model_state_dict(peft, state).unexpected_keys
    if unexpected:
        raise ValueError(f"stacked adapter keys not in the model: {unexpected[:3]}")
    return peft.merge_and_unload()


def save_merged(model, tok, out: Path, what: str = "") -> Path:
    """``save_pretrained`` of model and tokenizer into ``out`` atomically; GGUF bases as plain fp weights."""
    from transformers import AutoModelForCausalLM

    qc = getattr(model.config, "quantization_config", None)
    if qc is not None:
        # transformers marks a GGUF-loaded model quantised and refuses save_pretrained; its weights are already
        # dequantised, so a fresh model from the same config without quantization_config holds them exactly
        cfg = model.config
        del cfg.quantization_config
        clean = AutoModelForCausalLM.from_config(cfg, dtype=next(model.parameters()).dtype)
        clean.load_state_dict(model.state_dict())
        clean.generation_config = model.generation_config
        model = clean
    tmp = temp_sibling_dir(out)
    try:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if getattr(tok, "chat_template", None) and not (tmp / "chat_template.jinja").exists():
            cfg = json.loads((tmp / "tokenizer_config.json").read_text(encoding="utf-8"))
            cfg.setdefault("chat_template", tok.chat_template)
            (tmp / "tokenizer_config.json").write_text(dumps_json(cfg, indent=2), encoding="utf-8")
        log.info("merged %s into %s", what, out)
        return publish_dir(tmp, out, replace=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
