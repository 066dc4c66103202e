"""smoke-digits: an MLP on scikit-learn's digits (real 8×8 images), to exercise the run machinery.

It is not a research method: it exists so that the core (configs, run folder, atomic checkpoints, resume,
reports) has a fast end-to-end check that needs no method. Test accuracy of a 1-hidden-layer MLP on digits is
about 0.95-0.98 after a few epochs, which the test suite uses as a sanity bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from reprlab.report import Section
from reprlab.report.figures import pyplot
from reprlab.report.headline import Headline
from reprlab.runs import Run
from reprlab.train.schedule import warmup_cosine
from reprlab.train.seed import generator


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = field(default=10, metadata={"help": "passes over the training split"})
    batch_size: int = field(default=64, metadata={"help": "examples per step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW peak learning rate"})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=10, metadata={"help": "linear warm-up steps"})
    checkpoint_every: int = field(default=20, metadata={"help": "steps between checkpoints"})


@dataclass(frozen=True)
class Config:
    seed: int = field(default=0, metadata={"help": "seed for split, init and data order"})
    hidden: int = field(default=64, metadata={"help": "MLP hidden width"})
    test_fraction: float = field(
        default=0.25, metadata={"help": "share of digits held out", "gt": 0, "lt": 1}
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda, cuda:N or auto (the MLP is tiny: cpu)"})
    train: TrainConfig = field(default_factory=TrainConfig)


class Interrupted(RuntimeError):
    """Raised when ``REPRLAB_SMOKE_STOP_AFTER`` is set, to simulate a killed run in tests.

    An environment variable rather than a config key, because a resumed run must have the same config.
    """


def _data(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)  # (1797, 64) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=generator(cfg.seed))
    n_test = int(len(x) * cfg.test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def run(cfg: Config, run: Run) -> dict:
    xtr, ytr, xte, yte = (t.to(run.device) for t in _data(cfg))
    torch.manual_seed(cfg.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, cfg.hidden), torch.nn.GELU(), torch.nn.Linear(cfg.hidden, 10)
    )
    model = model.to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    steps_per_epoch = (len(xtr) + cfg.train.batch_size - 1) // cfg.train.batch_size
    total = cfg.train.epochs * steps_per_epoch
    sched = warmup_cosine(opt, cfg.train.warmup_steps, total)
    step = 0
    if run.resume and (state := run.load_checkpoint({"model": model}, {"opt": opt})) is not None:
        step, extra = state
        sched.load_state_dict(extra["scheduler"])
    stop_after = (
        int(os.environ["REPRLAB_SMOKE_STOP_AFTER"]) if os.environ.get("REPRLAB_SMOKE_STOP_AFTER") else None
    )
    order_gen = generator(cfg.seed + 1)
    orders = [torch.randperm(len(xtr), generator=order_gen).to(run.device) for _ in range(cfg.train.epochs)]
    for global_step in run.progress(range(step, total), total=total - step, desc="smoke-digits"):
        epoch, i = divmod(global_step, steps_per_epoch)
        idx = orders[epoch][i * cfg.train.batch_size : (i + 1) * cfg.train.batch_size]
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step = global_step + 1
        run.log(step, loss=loss.item(), lr=sched.get_last_lr()[0])
        if step % cfg.train.checkpoint_every == 0 or step == total:
            if step % steps_per_epoch == 0 or step == total:
                with torch.no_grad():
                    acc = (model(xte).argmax(-1) == yte).float().mean().item()
                run.log(step, test_acc=acc)
            run.save_checkpoint(step, {"model": model}, {"opt": opt}, extra={"scheduler": sched.state_dict()})
        if stop_after is not None and step >= stop_after:
            raise Interrupted(f"stopped after step {step} (REPRLAB_SMOKE_STOP_AFTER)")
    with torch.no_grad():
        logits = model(xte)
    acc = (logits.argmax(-1) == yte).float().mean().item()
    confusion = np.zeros((10, 10), dtype=int)
    for t, p in zip(yte.tolist(), logits.argmax(-1).tolist()):
        confusion[t, p] += 1
    run.save_json("artifacts/confusion.json", confusion.tolist())
    return {"test_acc": acc, "final_loss": F.cross_entropy(logits, yte).item(), "steps": step}


SUMMARY_KINDS = {"test_acc": "proportion"}  # a share of test digits: Wilson intervals over seeds
HEADLINE = Headline(rows=(("test accuracy", "test_acc"), ("final test cross-entropy", "final_loss"),
                          ("training steps", "steps")), caption="Held-out digits")  # fmt: skip


def report_sections(run_dir: Path) -> list[Section]:
    from reprlab.runs import read_json

    path = Path(run_dir) / "artifacts" / "confusion.json"
    if not path.exists():
        return []
    confusion = np.array(read_json(path))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    im = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(10))
    ax.set_yticks(range(10))
    ax.set_xlabel("predicted digit")
    ax.set_ylabel("true digit")
    ax.set_title("Test confusion matrix")
    ax.grid(False)
    fig.colorbar(im, ax=ax, label="test items")
    return [
        Section(
            "Test confusion matrix", text="scikit-learn digits (real 8×8 scans), held-out split.", figure=fig
        )
    ]
