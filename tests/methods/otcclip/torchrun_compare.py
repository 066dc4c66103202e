"""One process against ``torchrun --nproc_per_node 2`` (gloo) on the same shards: the shared half of the streamed
trainer's DDP tests (test_stream.py for TinyCLIP, test_openclip.py for an open_clip model,
test_stream_clean_set.py for CleanCLIP's clean stream). The worker script trains OTCCLIP for 2 epochs (or
CleanCLIP) and saves ``{"world", "stats", "init", "state"}``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[3]


def one_vs_two_ranks(
    worker: Path,
    shards: Path,
    out: Path,
    timeout: int = 600,
    extra: tuple[str, ...] = (),
    defense: str = "otcclip",
) -> tuple[dict, dict]:
    """Run ``worker`` as one process with 2 DataLoader workers and as 2 gloo ranks x 1 worker; check that both
    logged the same epochs (the CLIP term over the gathered batch to 1e-5 relative, the rank-averaged total to
    1e-4, the data and re-matching counts exactly); return both saved results. ``extra``: more worker arguments;
    ``defense``: the one the worker trains (``otcclip``: its second epoch must be a re-matching epoch that saw
    the 4 poisons)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "REPRLAB_QUIET": "1"}
    runs = {
        "one": [sys.executable, str(worker), str(shards), str(out / "one.pt"), "2", *extra],
        "two": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(worker), str(shards), str(out / "two.pt"), "1", *extra],
    }  # fmt: skip
    res = {}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res[name] = torch.load(out / f"{name}.pt")
    one, two = res["one"], res["two"]
    assert two["world"] == 2 and one["world"] == 1
    if defense == "otcclip":
        assert one["stats"][1]["phase"] == "otc_match" and one["stats"][1]["n_poison_seen"] == 4
    assert len(one["stats"]) == len(two["stats"])
    for a, b in zip(one["stats"], two["stats"]):
        assert a["phase"] == b["phase"]
        # the CLIP term is over the gathered global batch, the OT terms are rank-local means (averaged over ranks
        # for the log): float32 sums in another order, measured <= 8e-7 relative
        assert b["loss_clip"] == pytest.approx(a["loss_clip"], rel=1e-5)
        # the logged total is averaged over ranks; its OT terms stop on a tolerance checked over the solver's batch
        # (a rank's half batch may stop at another iteration than the full batch): measured 2e-5 relative
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        for k in ("data_steps", "n_poison_seen", "rematch_poison_moved", "rematch_clean_kept"):
            assert a.get(k) == b.get(k), k
    return one, two
