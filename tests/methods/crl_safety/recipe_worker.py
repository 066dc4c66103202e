"""Worker of ``test_scale.py``: the crl-tiny pipeline on a tiny random Llama (``test_recipe.TINY`` with LoRA dropout
off, so ranks draw no masks of their own), as one process or under ``torchrun``; rank 0 writes the summary.
A second argument ``select`` turns on validation points and ``defense.select.rule=benign_floor``."""

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


def main(folder: str, select: bool = False) -> None:
    torch.set_num_threads(1)
    d = Path(folder)
    d.mkdir(exist_ok=True)
    t = {**TINY, "data": {**TINY["data"], "user_jsonl": compliant_jsonl(d)}}
    t["sft"] = {"optim": {"steps": 2, "batch_size": 2}, "lora": {"dropout": 0.0}}
    t["defense"] = {**t["defense"], "lora": {"dropout": 0.0}}
    if select:  # validation points every step and the benign_floor rule
        t["data"] = {**t["data"], "n_harmless_val": 3, "n_harmful_val": 2}
        t["defense"] = {**t["defense"], "select": {"rule": "benign_floor", "every": 1}}
    cfg = load_config(R.Config, t)
    summary = R.run(cfg, Run.create(d / "run", cfg, "crl-tiny", quiet=True))
    summary.pop("seconds")
    if int(os.environ.get("RANK", "0")) == 0:
        (d / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1], select=sys.argv[2:] == ["select"])
