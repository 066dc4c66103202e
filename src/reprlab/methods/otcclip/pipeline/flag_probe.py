"""``reprlab otcclip flag-probe``: the flag probe (:mod:`..evaluation.flag_probe`) over a run folder's kept epoch
checkpoints (``train.keep_every``)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from reprlab.errors import ConfigError, DataFileMissingError, RunFolderError
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.evaluation.flag_probe import TESTS, FlagProbe, probe_epoch
from reprlab.methods.otcclip.models.run_model import load_run_model, run_config
from reprlab.methods.otcclip.pipeline.preflight import streaming
from reprlab.runs.checkpoint import load_checkpoint_dir


def probe_run(
    run_dir: Path, epochs: list[int], defense: str = "otcclip", n_blend: int = 8
) -> list[FlagProbe]:
    """:func:`probe_epoch` at each of ``epochs`` of an in-memory testbed run of ``defense`` (its kept checkpoints:
    ``train.keep_every``), with the run's thread count (``threads``), so that the release it recomputes is the
    trainer's outside the flag's own epochs (on the device and CPU kind the run used; elsewhere up to ties at the
    bar).

    Raises:
        RunFolderError: not a run folder; a streamed run.
        ConfigError: a defense the run did not train or without a flag; an epoch outside 1..train.epochs.
        DataFileMissingError: an epoch without a kept checkpoint (named, with the key that keeps it).
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)  # RunFolderError without config.yaml
    if defense not in cfg.defenses:
        raise ConfigError(f"defense {defense!r} was not trained in {run_dir}; it has {list(cfg.defenses)}")
    if streaming(cfg):
        raise RunFolderError(
            f"{run_dir} trained from a stream (stream.* or data.testbed=files): the flag probe rebuilds the in-memory "
            "testbed, whose poisons it knows, so it reads in-memory testbed runs only"
        )
    if defense != "otcclip":
        raise ConfigError(
            f"the flag probe reads OTCCLIP's consensus flag: --defense otcclip, not {defense!r}"
        )
    if cfg.defense.flag == "none":
        raise ConfigError(f"{run_dir} trained OTCCLIP without a flag (defense.flag=none): nothing to probe")
    bad = [e for e in epochs if not 1 <= e <= cfg.train.epochs]
    if bad or not epochs:
        raise ConfigError(
            f"--epochs takes epochs between 1 and train.epochs ({cfg.train.epochs}) of {run_dir}; got {epochs}"
        )
    model, tok, _ = load_run_model(run_dir, defense)
    model.eval()
    bed = build_testbed(cfg.data, cfg.seed)
    pairs = bed.pairs
    noisy = torch.zeros(len(pairs), dtype=torch.bool)
    if bed.noisy_rows is not None:
        noisy[bed.noisy_rows] = True
    ids, mask = tok.encode(pairs.captions, model.cfg.max_len)  # the trainer's length (trainer.py)
    threads = torch.get_num_threads()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        out = []
        for epoch in epochs:
            folder = run_dir / "checkpoints" / defense / f"step_{epoch:08d}"
            if not (folder / "state.safetensors").is_file():
                raise DataFileMissingError(
                    f"{folder} not found: the run kept no checkpoint after {epoch} epochs of {defense}",
                    hint="train with train.keep_every=1 to keep every epoch's checkpoint",
                )
            load_checkpoint_dir(folder, {"model": model}, None, restore_rng=False)
            state = load_file(str(folder / "state.safetensors"))
            safe = state["safe"].bool()
            held = state["held"].bool() if "held" in state else torch.zeros_like(safe)
            out.append(
                probe_epoch(model, pairs, ids, mask, safe, held, cfg.defense, epoch, n_blend, cfg.seed, noisy)
            )
    finally:
        torch.set_num_threads(threads)
    return out


def table(probes: list[FlagProbe]) -> str:
    """A Markdown table of :func:`probe_run`'s answer, one row per epoch."""
    head = "| epoch | flagged clean / backdoor | release: clean / backdoor | " + " | ".join(TESTS)
    head += " | target's clean flagged | other clean flagged | re-matched: clean to own concept | backdoor to target |"
    lines = [head, "|" + "---|" * (len(TESTS) + 7)]
    for p in probes:
        cells = " | ".join(f"{p.auroc[t]:.3f}" for t in TESTS)
        lines.append(
            f"| {p.epoch} | {p.flagged_clean} / {p.flagged_backdoor} | {p.released_clean} / {p.released_backdoor} "
            f"| {cells} | {p.target_clean_flagged:.2f} | {p.other_clean_flagged:.2f} "
            f"| {p.rematch_clean_own_concept:.2f} | {p.rematch_backdoor_to_target:.2f} |"
        )
    return "\n".join(lines)
