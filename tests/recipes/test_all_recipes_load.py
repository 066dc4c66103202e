"""Every shipped recipe YAML parses, names an importable entry, and builds its typed config
(torchtune's 'every config loads' test). Demo overrides must build too."""

import pytest

from reprlab.recipes import all_recipes

RECIPES = sorted(all_recipes())


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_builds_config(name):
    recipe = all_recipes()[name]
    cfg = recipe.build_config()
    assert hasattr(cfg, "seed"), f"{name}: Config has no seed"
    if recipe.demo:
        recipe.build_config(list(recipe.demo))
    first = recipe.path.read_text().splitlines()[0]
    assert first.startswith("# reprlab run"), f"{recipe.path}: first line must be the launch command"
    module = recipe.module()
    assert callable(module.run)


def test_unknown_recipe_suggests_closest():
    from reprlab.recipes import get_recipe

    with pytest.raises(KeyError, match="(?i)did you mean 'smoke-digits'"):
        get_recipe("smoke-digit")


def test_every_config_key_has_a_help_text():
    from reprlab.config.load import field_help
    from reprlab.recipes import all_recipes

    missing = {}
    for name, recipe in all_recipes().items():
        keys = [
            key for key, _, _, help_text in field_help(type(recipe.build_config([]))) if not help_text.strip()
        ]
        if keys:
            missing[name] = keys
    assert not missing, f"config keys without help (field metadata 'help'): {missing}"
