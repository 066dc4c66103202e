"""The recipe's configuration: one frozen dataclass per YAML section (a module each), composed into
:class:`Config`.

``reprlab run otcclip-*`` resolves a YAML recipe plus ``key=value`` overrides into one ``Config`` before anything
runs; every part of the package receives the section it needs from it (``cfg.model`` to the model builder,
``cfg.train`` and ``cfg.defense`` to the trainer, ...) and none reads configuration anywhere else. Each field's
``help`` says whose choice its default is ([ours] where the papers give none). This package imports nothing else
of ``otcclip``: every other part may import it. A new section is a module here and a field of ``Config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reprlab.methods.otcclip.config.data import TRIGGERS, DataConfig
from reprlab.methods.otcclip.config.defense import DEFAULT_DEFENSES, DefenseConfig
from reprlab.methods.otcclip.config.eval import EvalConfig
from reprlab.methods.otcclip.config.model import ModelConfig
from reprlab.methods.otcclip.config.ot import OTConfig
from reprlab.methods.otcclip.config.poison import PoisonConfig
from reprlab.methods.otcclip.config.stream import StreamConfig
from reprlab.methods.otcclip.config.train import TrainConfig
from reprlab.methods.otcclip.config.whole_set import whole_set_options


@dataclass(frozen=True)
class Config:
    """The whole recipe: top-level keys, then one section per part (``data``, ``model``, ``train``, ``defense``,
    ``stream``, ``poison``, ``eval``)."""

    seed: int = field(default=0, metadata={"help": "seed for data, poisons, init and order"})
    device: str = field(default="auto", metadata={"help": "'auto', 'cpu' or 'cuda'"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch default)"})
    defenses: tuple[str, ...] = field(
        default=DEFAULT_DEFENSES, metadata={"help": "defenses to train, in order"}
    )
    audit_defense: str = field(
        default="none", metadata={"help": "model the audit is measured with ('' = skip)"}
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    defense: DefenseConfig = field(default_factory=DefenseConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    poison: PoisonConfig = field(default_factory=PoisonConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


__all__ = [
    "DEFAULT_DEFENSES",
    "TRIGGERS",
    "Config",
    "DataConfig",
    "DefenseConfig",
    "EvalConfig",
    "ModelConfig",
    "OTConfig",
    "PoisonConfig",
    "StreamConfig",
    "TrainConfig",
    "whole_set_options",
]
