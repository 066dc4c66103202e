"""Choosing a defence's training step on validation prompts [ours] (``defense.select``).

Why: a defence trained for a fixed number of steps on a few dozen prompts overshoots into refusing harmless
prompts it was not tuned on (measured: crl-tiny, seed 0, 24 Alpaca-style harmless prompts of ollama-forge:
stage 0 answers 0.50, CRL after its 32 steps 0.25). The paper fixes the number of steps; it selects nothing we
know of. Rule ``benign_floor``: at every validation point the adapter is snapshotted and measured on validation
prompts (drawn from the training source, disjoint from training and evaluation, never reported as results):
benign compliance on the harmless ones and the prefilling attack's success on the harmful ones. The chosen step
is the latest whose benign compliance is at least stage 0's minus ``tolerance``; when none is, ``fallback``
decides: ``earliest``, the earliest validation step (the one closest to stage 0, which may defend nothing), or
``balanced``, the latest step with the highest benign compliance minus prefill ASR (measured: on crl-cross-tiny
seed 1 no step reached the floor, and the earliest step left stage 0's prefill ASR in place). The chosen snapshot
is what gets exported and evaluated.

Run-folder layout (each file written atomically; a resumed run reads back the points it had measured)::

    selection/<kind>/step_<NNNNNNNN>.safetensors   adapter tensors of the defence at that local step
    selection/<kind>/step_<NNNNNNNN>.json          {"step", "benign_compliance", "asr_prefill", labels...}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from reprlab.runs.atomic import atomic_write_bytes, atomic_write_json, read_json


@dataclass(frozen=True)
class Choice:
    """What the rule picked.

    Attributes:
        step: the chosen local step (1-based: the adapter after that many optimizer steps).
        floor: the benign-compliance floor (stage 0's validation benign compliance - tolerance; NaN for 'last').
        qualified: whether the chosen step meets the floor (False: none did, the earliest was taken).
    """

    step: int
    floor: float
    qualified: bool


def validation_steps(n_steps: int, every: int) -> list[int]:
    """Local steps (1-based) at which a defence of ``n_steps`` steps is validated: every ``every`` and the last."""
    if every < 1:
        raise ValueError(f"validation every must be >= 1, got {every}")
    return sorted({s for s in range(every, n_steps + 1, every)} | {n_steps})


def choose_step(points: list[dict], reference: float, tolerance: float, rule: str = "benign_floor",
                fallback: str = "earliest") -> Choice:  # fmt: skip
    """The step the rule picks from validation ``points`` (dicts with ``step``, ``benign_compliance`` and, for the
    ``balanced`` fallback, ``asr_prefill``).

    Args:
        reference: stage 0's validation benign compliance.
        tolerance: how far below ``reference`` a step may fall and still qualify.
        rule: ``'benign_floor'`` or ``'last'`` (the latest point, whatever its numbers).
        fallback: when no step qualifies, ``'earliest'`` or ``'balanced'`` (the latest step maximising benign
            compliance minus prefill ASR).

    Raises:
        ValueError: no points, or an unknown rule or fallback.
    """
    if not points:
        raise ValueError("no validation points to choose from")
    if fallback not in ("earliest", "balanced"):
        raise ValueError(f"unknown selection fallback {fallback!r}")
    pts = sorted(points, key=lambda p: p["step"])
    if rule == "last":
        return Choice(pts[-1]["step"], float("nan"), True)
    if rule != "benign_floor":
        raise ValueError(f"unknown selection rule {rule!r}")
    floor = reference - tolerance
    # a tiny slack: compliance is a share k/n, so the floor reached exactly must not fail on rounding
    ok = [p for p in pts if p["benign_compliance"] >= floor - 1e-9]
    if ok:
        return Choice(ok[-1]["step"], floor, True)
    if fallback == "earliest":
        return Choice(pts[0]["step"], floor, False)
    score = [p["benign_compliance"] - p["asr_prefill"] for p in pts]
    best = max(score)
    # the same slack: scores are differences of shares, so equal ones must tie; ties go to the latest step
    return Choice([p for p, s in zip(pts, score) if s >= best - 1e-9][-1]["step"], floor, False)


class Snapshots:
    """Validation points of one defence in ``<run>/selection/<kind>/`` (rank 0 writes; every rank keeps the
    points it measured in memory, so no rank reads a file another rank may still be writing)."""

    def __init__(self, run_dir: Path | str, kind: str, write: bool = True):
        self.dir = Path(run_dir) / "selection" / kind
        self.write = write
        self._mem: dict[int, tuple[dict, dict[str, Tensor]]] = {}

    def _stem(self, step: int) -> Path:
        return self.dir / f"step_{step:08d}"

    def save(self, step: int, point: dict, tensors: dict[str, Tensor]) -> None:
        """Keep and (rank 0) write one point: tensors first, then the JSON, so a JSON implies its tensors."""
        from safetensors.torch import save

        cpu = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
        self._mem[step] = (dict(point), cpu)
        if self.write:
            atomic_write_bytes(self._stem(step).with_suffix(".safetensors"), save(cpu))
            atomic_write_json(self._stem(step).with_suffix(".json"), point)

    def point(self, step: int) -> dict:
        if step in self._mem:
            return self._mem[step][0]
        path = self._stem(step).with_suffix(".json")
        if not path.exists():
            raise FileNotFoundError(f"{path}: validation point of step {step} missing (run folder damaged?)")
        return read_json(path)

    def tensors(self, step: int) -> dict[str, Tensor]:
        if step in self._mem:
            return self._mem[step][1]
        from safetensors.torch import load_file

        return load_file(str(self._stem(step).with_suffix(".safetensors")))

    def has(self, step: int) -> bool:
        return step in self._mem or self._stem(step).with_suffix(".json").exists()


def adapter_tensors(model) -> dict[str, Tensor]:
    """The trainable (adapter) tensors of ``model`` by parameter name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def load_adapter_tensors(model, tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` (from :func:`adapter_tensors`) into the live adapter of ``model``.

    Raises:
        ValueError: the names differ from the model's trainable parameters.
    """
    live = adapter_tensors(model)
    if set(live) != set(tensors):
        missing, extra = sorted(set(live) - set(tensors))[:3], sorted(set(tensors) - set(live))[:3]
        raise ValueError(f"snapshot does not fit the adapter (missing {missing}, unexpected {extra})")
    for n, p in live.items():
        p.copy_(tensors[n].to(device=p.device, dtype=p.dtype))
