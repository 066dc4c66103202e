"""Recipe discovery: every ``methods/<method>/recipes/<name>.yaml`` is a runnable recipe.

A recipe YAML holds ``description``, ``entry`` (the module defining ``Config``, ``run`` and optionally
``report_sections``), optional ``demo`` overrides for the short variant used by ``reprlab demo``, and
``config`` (composes the entry's ``Config``). Discovery reads YAML only, so listing recipes imports no torch.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from reprlab.errors import ConfigError, RecipeError
from reprlab.results.claims import Claim, parse_claims

METHODS_DIR = Path(__file__).resolve().parent / "methods"
REQUIRED_KEYS = ("description", "entry", "config")
KNOWN_KEYS = (*REQUIRED_KEYS, "base", "demo", "demo_order", "claims")


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    entry: str
    config: dict[str, Any]
    demo: tuple[str, ...] = ()
    demo_order: int | None = None
    raw_claims: tuple[dict[str, Any], ...] | None = None

    @property
    def method(self) -> str:
        return self.path.parent.parent.name

    def module(self) -> ModuleType:
        try:
            mod = importlib.import_module(self.entry)
        except ImportError as err:
            raise ImportError(
                f"recipe {self.name} ({self.path}): cannot import entry {self.entry!r}: {err}"
            ) from err
        for attr in ("Config", "run"):
            if not hasattr(mod, attr):
                raise AttributeError(f"recipe {self.name}: entry module {self.entry} defines no {attr!r}")
        return mod

    def claims(self) -> tuple[Claim, ...]:
        """The claims this recipe tests: its YAML's ``claims:`` list, else the entry module's ``CLAIMS``."""
        raw = self.raw_claims if self.raw_claims is not None else getattr(self.module(), "CLAIMS", None)
        return parse_claims(list(raw) if raw is not None else None, str(self.path))

    def summary_kinds(self) -> dict[str, str]:
        """``{fnmatch pattern: kind}`` of summary keys from the entry module's ``SUMMARY_KINDS`` (which keys are
        proportions; :mod:`reprlab.results.intervals`)."""
        from reprlab.results.intervals import check_kinds

        kinds = dict(getattr(self.module(), "SUMMARY_KINDS", None) or {})
        check_kinds(kinds, self.entry)
        return kinds

    def build_config(self, overrides: list[str] | tuple[str, ...] = ()) -> Any:
        from reprlab.config import load_config

        return load_config(self.module().Config, self.config, overrides)


_LOADED: dict[tuple[str, int, int], Recipe] = {}  # (path, mtime_ns, size) -> parsed recipe
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: ~20x faster than pure Python


def load_recipe_file(path: Path) -> Recipe:
    """Parse and validate one recipe YAML; errors name the file. Unchanged files are parsed once a process."""
    st = path.stat() if path.is_file() else None
    key = (str(path), st.st_mtime_ns, st.st_size) if st is not None else None
    if key is not None and key in _LOADED:
        return _LOADED[key]
    recipe = _parse_recipe_file(path)
    if key is not None:
        _LOADED[key] = recipe
    return recipe


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, mappings merged key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_recipe_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe file's mapping, with its ``base:`` recipe (a sibling YAML) resolved underneath it: the base's
    keys (but ``demo_order``), ``config`` merged key by key with this file's, every other key this file's where it
    gives one."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_YAML_LOADER)  # noqa: S506 - a safe loader
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe file {path} is not valid YAML: {err}") from err
    except OSError as err:
        raise ConfigError(f"recipe file {path} cannot be read: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file {path} must be a mapping with keys {', '.join(REQUIRED_KEYS)}")
    if "base" not in data:
        return data
    name = data.pop("base")
    base_path = path.parent / f"{name}.yaml"
    if not isinstance(name, str) or not base_path.is_file():
        raise ConfigError(f"recipe file {path}: base {name!r} is not a recipe in {path.parent}")
    if base_path in (*chain, path):
        raise ConfigError(f"recipe file {path}: base recipes form a loop through {base_path}")
    base = _read_recipe_yaml(base_path, (*chain, path))
    # demo_order is not inherited: a variant joins `reprlab demo` only when it says so
    merged = {
        **{k: v for k, v in base.items() if k != "demo_order"},
        **{k: v for k, v in data.items() if k != "config"},
    }
    merged["config"] = _merge(base.get("config") or {}, data.get("config") or {})
    return merged


def _parse_recipe_file(path: Path) -> Recipe:
    data = _read_recipe_yaml(path)
    missing = [k for k in REQUIRED_KEYS if k not in data]
    unknown = [k for k in data if k not in KNOWN_KEYS]
    if missing or unknown:
        raise ConfigError(
            f"recipe file {path}: missing keys {missing}, unknown keys {unknown}; valid: {KNOWN_KEYS}"
        )
    recipe = Recipe(
        name=path.stem, path=path, description=str(data["description"]).strip(), entry=data["entry"],
        config=data["config"] or {}, demo=tuple(data.get("demo") or ()), demo_order=data.get("demo_order"),
        raw_claims=tuple(data["claims"]) if data.get("claims") is not None else None,
    )  # fmt: skip
    parse_claims(
        list(recipe.raw_claims) if recipe.raw_claims is not None else None, str(path)
    )  # fail at load
    return recipe


def all_recipes(methods_dir: Path = METHODS_DIR) -> dict[str, Recipe]:
    """Every recipe found, by name."""
    out: dict[str, Recipe] = {}
    for path in sorted(methods_dir.glob("*/recipes/*.yaml")):
        recipe = load_recipe_file(path)
        if recipe.name in out:
            raise ConfigError(
                f"recipe name {recipe.name} is defined twice: {out[recipe.name].path} and {path}"
            )
        out[recipe.name] = recipe
    return out


def get_recipe(name: str) -> Recipe:
    """Find a recipe by name, or by path to a YAML file."""
    if name.endswith((".yaml", ".yml")):
        if not Path(name).is_file():
            raise RecipeError(f"recipe file {name} does not exist")
        return load_recipe_file(Path(name))
    recipes = all_recipes()
    if name not in recipes:
        close = difflib.get_close_matches(name, list(recipes), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(f"unknown recipe {name!r}.{hint} Available: {', '.join(sorted(recipes))}")
    return recipes[name]


def saved_config(run_dir: Path) -> dict[str, Any]:
    """A run folder's resolved config as written (``config.yaml``) as a plain dict; ``{}`` when it has none. For
    reports, which read a few keys and must work on folders of older versions (no typed load)."""
    path = Path(run_dir) / "config.yaml"
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or {}) if path.exists() else {}


def recipe_name_of_run(run_dir: Path) -> str | None:
    """The recipe a run folder was made by, from the first line of its config.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        return None
    first = path.read_text(encoding="utf-8").splitlines()[:1]
    if first and first[0].startswith("# recipe:"):
        return first[0].split(":", 1)[1].strip()
    return None
