"""otcclip-*: one poisoned image-caption dataset, four defenses trained side by side, one comparison.

Setup -> train -> evaluate -> report:

1. Data [ours]: Fashion-MNIST mosaics with compositional captions, plus targeted poisons (held-out test-split
   targets x N natural captions naming a wrong class) and a backdoor (:mod:`..data.testbed`), at rates far above
   web scale because the dataset is tiny: the undefended model must be attacked, or no defense can be judged.
2. Train the same CLIP from the same initialisation under each defense (:mod:`.fit`); each epoch is checkpointed
   under the defense's tag and a finished defense is a run stage, so ``--resume`` continues where a run stopped.
   With ``stream.source`` or ``stream.write_shards`` the data is streamed instead (:mod:`.run_stream`).
3. Evaluate zero-shot (prompt ensemble), linear probe, ASR_targeted, ASR_backdoor (the RoCLIP/CleanCLIP
   definitions, :mod:`..evaluation.metrics`) and, for the matching defenses, re-matching quality of the last
   matching epoch; then the audit of the poisoned pairs (:mod:`.audit`).
4. ``report_sections`` (:mod:`.report`) rebuilds the table and plots from the saved files only.
"""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.data.testbed import build_testbed, testbed_info
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.build import build_tokenizer
from reprlab.methods.otcclip.models.run_model import save_tokenizer
from reprlab.methods.otcclip.pipeline.audit import audit_testbed
from reprlab.methods.otcclip.pipeline.fit import train_defense
from reprlab.methods.otcclip.pipeline.preflight import preflight, streaming
from reprlab.methods.otcclip.pipeline.run_stream import run_stream
from reprlab.runs import Run
from reprlab.train.dist import init_distributed
from reprlab.train.seed import seed_everything

PAIRED = {"zeroshot": "zeroshot_acc", "probe": "linear_probe_acc"}


def paired_differences(results: dict[str, dict]) -> dict[str, float]:
    """Per-seed accuracy differences [ours], so a sweep's interval of their mean is a paired interval:
    ``paired.<d>_vs_none.<zeroshot|probe>`` for every defense ``d`` trained beside ``none``, and
    ``paired.otcclip_vs_best.<...>``: OTCCLIP minus the better of RoCLIP-style and SafeCLIP-style on this seed."""
    out = {}
    for short, key in PAIRED.items():
        if key in results.get("none", {}):
            for d, res in results.items():
                if d != "none" and key in res:
                    out[f"paired.{d}_vs_none.{short}"] = res[key] - results["none"][key]
        base = [results[d][key] for d in ("roclip", "safeclip") if key in results.get(d, {})]
        if base and key in results.get("otcclip", {}):
            out[f"paired.otcclip_vs_best.{short}"] = results["otcclip"][key] - max(base)
    return out


def run(cfg: Config, run: Run) -> dict:
    """Train and evaluate every defense of ``cfg`` (module docstring); returns the flat summary."""
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    preflight(cfg)  # again: library callers of run() skip the runner's hook
    seed_everything(cfg.seed)
    if streaming(cfg):
        return run_stream(cfg, run)
    # a plain launch is one rank (the trainer is then unchanged); under torchrun the ranks split each batch
    dist = init_distributed(device="cpu" if run.device.type == "cpu" else None)
    bed = build_testbed(cfg.data, cfg.seed)
    tok = build_tokenizer(cfg.model) or WordTokenizer.from_texts(bed.pairs.captions)
    save_tokenizer(run, tok)
    data_info = {"n_pairs": len(bed.pairs), "vocab": len(tok), "testbed": cfg.data.testbed}
    data_info.update(testbed_info(cfg.data, bed, bed.pairs.kind))
    run.save_json("analysis/data.json", data_info)
    summary: dict[str, float | int | str] = {
        "n_pairs": len(bed.pairs),
        "poison_rate": data_info["poison_rate"],
    }
    results = {}
    for defense in cfg.defenses:
        res = run.stage(defense, lambda d=defense: train_defense(d, cfg, run, bed, tok, dist))
        results[defense] = res["metrics"]
        run.save_json(f"analysis/examples_{defense}.json", res["examples"])
        for key, value in res["metrics"].items():
            summary[f"{defense}.{key}"] = value
    run.save_json("analysis/results.json", results)
    summary.update(paired_differences(results))
    if cfg.audit_defense in cfg.defenses:
        audit = run.stage("audit", lambda: audit_testbed(cfg, run, bed, tok))
        run.save_json("analysis/audit.json", audit)
        summary.update({f"audit.{k}": v for k, v in audit.items() if not isinstance(v, dict | list)})
    return summary
