from dataclasses import dataclass, field
from typing import Literal

import pytest

from reprlab.config import ConfigError, config_to_dict, load_config


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    steps: int = 10
    layers: tuple[int, ...] = (1, 2)
    schedule: Literal["cosine", "constant"] = "cosine"


@dataclass(frozen=True)
class Root:
    seed: int = 0
    name: str | None = None
    use_amp: bool = False
    train: Optim = field(default_factory=Optim)


def test_yaml_then_overrides_compose_with_types():
    cfg = load_config(
        Root,
        {"train": {"lr": 2, "steps": 3}},
        ["train.steps=5", "train.layers=[3,4]", "name=x", "use_amp=true", "train.lr=3e-4"],
    )
    assert cfg == Root(seed=0, name="x", use_amp=True, train=Optim(lr=3e-4, steps=5, layers=(3, 4)))
    assert isinstance(cfg.train.lr, float) and isinstance(cfg.train.layers, tuple)


def test_frozen():
    cfg = load_config(Root)
    with pytest.raises(AttributeError):
        cfg.seed = 3  # type: ignore[misc]


def test_unknown_key_names_valid_keys_and_closest_match():
    with pytest.raises(ConfigError) as err:
        load_config(Root, {}, ["train.lrr=1"])
    msg = str(err.value)
    assert "'lrr'" in msg and "did you mean 'lr'" in msg and "layers, lr, schedule, steps" in msg


def test_unknown_key_in_yaml_is_caught_too():
    with pytest.raises(ConfigError, match="did you mean 'seed'"):
        load_config(Root, {"sed": 1})


def test_wrong_type_names_full_path_and_type():
    with pytest.raises(ConfigError, match=r"train\.steps: expected int, got 'abc'"):
        load_config(Root, {}, ["train.steps=abc"])
    with pytest.raises(ConfigError, match=r"train\.schedule: expected one of \['cosine', 'constant'\]"):
        load_config(Root, {}, ["train.schedule=linear"])
    with pytest.raises(ConfigError, match="not a group of keys"):
        load_config(Root, {}, ["seed.x=1"])


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(Root, {}, ["train.lr"])


def test_optional_none_and_roundtrip():
    cfg = load_config(Root, {"name": "a"}, ["name=none"])
    assert cfg.name is None
    assert load_config(Root, config_to_dict(cfg)) == cfg


def test_override_that_yaml_11_would_read_as_base_60_stays_a_string():
    from reprlab.config.load import parse_overrides

    # "1e-3" stays a string too (YAML 1.1 wants a dot); the typed field turns it into a float later
    assert parse_overrides(["a=2:3", "b=0x10", "c=1e-3", "d=7", "e=[1, 2]"]) == {
        "a": "2:3", "b": "0x10", "c": "1e-3", "d": 7, "e": [1, 2]}  # fmt: skip


def test_empty_override_is_the_empty_string_and_null_is_none():
    from reprlab.config.load import parse_overrides

    assert parse_overrides(["a=", "b=null", "c=''"]) == {"a": "", "b": None, "c": ""}
