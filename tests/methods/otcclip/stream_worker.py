"""Worker of the streamed trainer's DDP tests (``torchrun_compare.py``): OTCCLIP 2 epochs from shards, as one process
or under ``torchrun`` (gloo); rank 0 saves the epoch stats, the initial and the final weights. ``ARCH`` ``tiny``
(test_stream.py: TinyCLIP, our word tokenizer) or an ``open_clip:<name>`` (test_openclip.py, through
OpenCLIPAdapter; only where open-clip-torch imports, the side venv of scripts/openclip_env.sh). With ``CLEAN`` (a
folder of clean shards) it trains CleanCLIP instead, 3 epochs: epoch 0 pre-trains on ``SHARDS``, epochs 1-2
fine-tune on the clean stream (test_stream_clean_set.py).

Usage: ``stream_worker.py SHARDS OUT NUM_WORKERS [ARCH [CLEAN]]``.
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[3]))  # the repository root, for the tests package

from reprlab.methods.otcclip.config import (
    ModelConfig,  # noqa: E402
    StreamConfig,  # noqa: E402
    TrainConfig,  # noqa: E402
)
from reprlab.methods.otcclip.data.sources import ShardSource  # noqa: E402
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer  # noqa: E402
from reprlab.methods.otcclip.models.build import build_model, build_tokenizer  # noqa: E402
from reprlab.methods.otcclip.training import stream as st  # noqa: E402
from reprlab.train.dist import init_distributed  # noqa: E402
from tests.methods.otcclip.test_trainer import CFG, DCFG  # noqa: E402


def main(shards: str, out: str, workers: int, arch: str = "tiny", clean: str = "") -> None:
    torch.set_num_threads(1)
    info = init_distributed(device="cpu")
    src = ShardSource(shards)
    mcfg = CFG if arch == "tiny" else ModelConfig(arch=arch)  # open_clip: the sizes are its config's
    tok = build_tokenizer(mcfg) or WordTokenizer.from_texts(src.captions(1000))
    torch.manual_seed(0)
    model = build_model(mcfg, len(tok))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = StreamConfig(slots=4, num_workers=workers, window_batches=2, shuffle_buffer=2)
    defense, epochs, dcfg = (
        ("cleanclip", 3, replace(DCFG, cleanclip_start_epoch=1)) if clean else ("otcclip", 2, DCFG)
    )
    tr = st.StreamTrainer(model, src, tok, defense, TrainConfig(epochs=epochs, batch_size=8, warmup_steps=2, lr=0.5),
                          dcfg, 0, cfg, n_samples=src.count(), dist=info,
                          clean=ShardSource(clean) if clean else None)  # fmt: skip
    # Adam turns float-noise gradients (exactly-zero ones, e.g. attention key biases) into lr-sized steps: compare
    # with SGD, as the in-memory DDP test does
    tr.opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the trainer sets each step's lr from train.lr
    stats = [tr.run_epoch(e) for e in range(epochs)]
    if info.is_main:
        torch.save({"world": info.world_size, "stats": stats, "init": init, "state": model.state_dict()}, out)
    if info.enabled:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:6])
