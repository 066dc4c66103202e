"""Micro variants of every method's tiny recipe, run once per test session and shared.

Each goes through the whole pipeline (data, training, every analysis, claims, summary, report) like the
real recipe, on sizes that fit the fast suite. The determinism tests run each twice (one of them is this
one), the browser test opens their reports, the JSON test parses every file they wrote.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

ROTE_MICRO = ["threads=1", "task.n_train=600", "task.n_test=100", "task.n_val=100", "train.steps=60",
              "train.eval_every=30", "train.ckpt_every=30", "train.snapshot_every=30", "analysis.probe_items=120",
              "analysis.circuit_items=20", "analysis.inlp_iters=2", "analysis.neuron_random_draws=2",
              "analysis.circuit_nulls=1"]  # fmt: skip
OTC_MICRO = ["threads=1", "data.n_pairs=200", "data.backdoor_pairs=20", "data.n_targets=2",
             "data.captions_per_target=10", "train.epochs=3", "train.batch_size=50", "data.n_eval=100",
             "data.n_probe_train=100", "defense.rematch_warmup=1", "defense.rematch_every=1",
             "defense.bank_size=256"]  # fmt: skip
NORMIC_MICRO = [
    "ic.corpus=lee", "static.sgns_epochs=1", "vocab.n_eval=150", "vocab.n_fit=250", "vocab.top_k=8000",
    "decoder.enabled=false", "encoder.layers=[-1]", "encoder.input_table=false", "analysis.n_boot=30",
    "analysis.compositions=[sum,mean,ind,joint,inf,scaled_c,sif_pc,pooled]", "length.n_docs=2",
    "length.n_words=12", "length.n_points=4", "length.natural=lee", "length.compositions=[sum,mean,ind,pooled]",
]  # fmt: skip
SMOKE_MICRO = ["train.epochs=2"]


def flat_overrides(config: dict, prefix: str = "") -> list[str]:
    """``key=value`` overrides that set every leaf of a nested config dict (lists in YAML flow style)."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += flat_overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value) if isinstance(value, list) else value}")
    return out


def crl_micro(folder: Path) -> list[str]:
    """The crl-tiny pipeline on a tiny random Llama, with user completions (tests/methods/crl_safety)."""
    from tests.methods.crl_safety.test_recipe import TINY, compliant_jsonl

    return flat_overrides({**TINY, "data": {**TINY["data"], "user_jsonl": compliant_jsonl(folder)}})


class MicroRuns:
    """``{name: run folder}`` made on first use under ``root``: a recipe name (each micro variant above),
    ``"smoke-sweep"`` (2 seeds of smoke-digits) or ``"demo"`` (a combined demo-style report over the four
    method runs, which makes them all). Each is made once, so tests asking for the same run share it."""

    PLAN = {
        "normic-tiny": NORMIC_MICRO,
        "rote-fda-tiny": ROTE_MICRO,
        "otcclip-mosaic-tiny": OTC_MICRO,
        "crl-tiny": None,
    }

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._made: dict[str, Path] = {}

    def overrides(self, name: str) -> list[str]:
        return crl_micro(self.root) if name == "crl-tiny" else list(self.PLAN[name])

    def __getitem__(self, name: str) -> Path:
        if name not in self._made:
            with (
                warnings.catch_warnings()
            ):  # micro sizes: Norm-IC's fit set is small for whitening on purpose
                warnings.filterwarnings("ignore", "whitening .* fit rows; the estimate is noisy", UserWarning)
                self._made[name] = self._make(name)
        return self._made[name]

    def _make(self, name: str) -> Path:
        import torch

        from reprlab.runner import execute

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # session fixtures run outside the suite's one-thread fixture: bit-equality
        try:
            if name == "smoke-sweep":
                from reprlab.sweep import run_sweep

                return run_sweep("smoke-digits", [0, 1], SMOKE_MICRO, self.root / "smoke-sweep", quiet=True)
            if name == "demo":
                return self._demo()
            self.root.mkdir(parents=True, exist_ok=True)
            return execute(name, self.overrides(name), self.root / "demo" / name, quiet=True)
        finally:
            torch.set_num_threads(threads)

    def _demo(self) -> Path:
        from reprlab.demo import build_demo_report
        from reprlab.runs.atomic import atomic_write_json

        runs = [{"recipe": n, "run_dir": n, "status": "ok", "overrides": self.overrides(n), "wall_time_s": None}
                for n in self.PLAN if self[n]]  # fmt: skip
        demo = self.root / "demo"
        atomic_write_json(demo / "demo.json", {"runs": runs})
        build_demo_report(demo)
        return demo
