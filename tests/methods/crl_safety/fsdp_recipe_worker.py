"""Worker of ``test_scale.py``: the crl pipeline with ``fsdp=true`` (stage 0, CRL, CRL+mining, every attack) on a
tiny random Llama folder with a real tokenizer, as one process (fsdp is then a logged no-op) or under
``torchrun`` (each stage trains an FSDP2-sharded twin); a folder that already holds a run is resumed.
Rank 0 writes ``summary.json`` beside the run folder."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_recipe import TINY, compliant_jsonl  # noqa: E402

from reprlab.config import load_config  # noqa: E402
from reprlab.methods.crl_safety import recipe as R  # noqa: E402
from reprlab.runs import Run  # noqa: E402

MODELS = ["refusal", "crl", "crl_adv"]
SFT_STEPS, DEFENSE_STEPS = 2, 4  # crl: steps 3..6, crl_adv: 7..10 (metrics.jsonl numbering)


def config(folder: Path, model_dir: str):
    """TINY with LoRA dropout off (ranks would draw masks of their own), checkpoints every 2 steps, the attack
    refreshed every 3 steps at a large lr (a run resumed at a checkpoint continues the saved attack, which moves the
    states), no MC check."""
    t = {**TINY, "model": model_dir, "models": MODELS, "fsdp": True, "capability": {"mc": False},
         "data": {**TINY["data"], "user_jsonl": compliant_jsonl(folder), "system_prompt": ""}}  # fmt: skip
    t["sft"] = {
        "optim": {"steps": SFT_STEPS, "batch_size": 2, "lr": 0.05, "log_every": 1},
        "lora": {"dropout": 0.0},
    }
    t["defense"] = {
        "optim": {"steps": DEFENSE_STEPS, "batch_size": 2, "lr": 0.05, "log_every": 1, "checkpoint_every": 2},
        "lora": {"dropout": 0.0},
        "mining": {"iterations": 2, "refresh_every": 3, "lr": 0.05, "gate_loss": 1e9, "prob": 1.0},
    }
    return load_config(R.Config, t)


def main(folder: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    d = Path(folder)
    d.mkdir(exist_ok=True)
    cfg = config(d, model_dir)
    out = d / "run"
    summary = R.run(cfg, Run.create(out, cfg, "crl-tiny", resume=out.exists(), quiet=True))
    summary.pop("seconds")
    if int(os.environ.get("RANK", "0")) == 0:
        (d / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(*sys.argv[1:])
