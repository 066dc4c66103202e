"""Every shipped recipe YAML parses, names an importable entry, and builds its typed config
(torchtune's 'every config loads' test). Demo overrides must build too."""

from dataclasses import replace

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


def test_a_recipe_with_a_base_merges_config_keywise_and_keeps_its_own_keys(tmp_path):
    from reprlab.errors import ConfigError
    from reprlab.recipes import load_recipe_file

    d = tmp_path / "m" / "recipes"
    d.mkdir(parents=True)
    (d / "parent.yaml").write_text(
        "description: parent\nentry: reprlab.methods.smoke.recipe\ndemo: [a=1]\ndemo_order: 3\n"
        "config:\n  seed: 4\n  data: {n: 10, k: 2}\nclaims:\n  - {name: c, text: t, check: '{x} > 0'}\n"
    )
    (d / "child.yaml").write_text("description: child\nbase: parent\nconfig:\n  data: {k: 5}\n")
    r = load_recipe_file(d / "child.yaml")
    assert r.description == "child" and r.entry == "reprlab.methods.smoke.recipe" and r.demo == ("a=1",)
    assert r.config == {"seed": 4, "data": {"n": 10, "k": 5}}  # key by key, the child's value wins
    assert [c["name"] for c in r.raw_claims] == [
        "c"
    ] and r.demo_order is None  # demo membership not inherited
    (d / "loop.yaml").write_text("description: loop\nbase: loop2\n")
    (d / "loop2.yaml").write_text("description: loop2\nbase: loop\n")
    with pytest.raises(ConfigError, match="form a loop"):
        load_recipe_file(d / "loop.yaml")
    (d / "orphan.yaml").write_text("description: o\nbase: nosuch\n")
    with pytest.raises(ConfigError, match="base 'nosuch' is not a recipe in"):
        load_recipe_file(d / "orphan.yaml")


def test_crl_cross_tiny_is_crl_tiny_evaluated_on_another_source():
    tiny, cross = (all_recipes()[n].build_config() for n in ("crl-tiny", "crl-cross-tiny"))
    assert cross.data.eval_source == "ollama_forge" and tiny.data.eval_source == "split"
    assert cross.defense == tiny.defense and cross.sft == tiny.sft
    # the cross-source check evaluates on more prompts; the attacks themselves are crl-tiny's
    assert replace(cross.attack, emb_prompts=tiny.attack.emb_prompts) == tiny.attack
    assert cross.data.n_harmless_eval > tiny.data.n_harmless_eval
    assert all_recipes()["crl-cross-tiny"].claims() == all_recipes()["crl-tiny"].claims()


def test_rote_fda_smollm2_is_the_tiny_task_on_the_packaged_smollm2():
    """The CPU SmolLM2 recipe changes the model and the sizes, never the task's noise or the claims."""
    tiny, smol = (all_recipes()[n].build_config() for n in ("rote-fda-tiny", "rote-fda-smollm2"))
    assert smol.model.hf_id == "smollm2-135m-instruct" and tiny.model.hf_id == ""
    assert (smol.task.noise_rate, smol.task.noise_mode, smol.task.digit_order) == (
        tiny.task.noise_rate, tiny.task.noise_mode, tiny.task.digit_order)  # fmt: skip
    assert smol.train.stop_memorized == tiny.train.stop_memorized
    assert all_recipes()["rote-fda-smollm2"].claims() == all_recipes()["rote-fda-tiny"].claims()


def test_otcclip_shards_tiny_is_otcclip_mosaic_tiny_streamed_from_shards():
    """The shards recipe inherits otcclip-mosaic-tiny (base:): the testbed, model, training, defenses and claims are the
    same, so the two recipes' numbers compare; only the data path (stream.*) differs."""
    import dataclasses

    tiny, shards = (all_recipes()[n].build_config() for n in ("otcclip-mosaic-tiny", "otcclip-shards-tiny"))
    for block in ("data", "model", "train", "defense"):
        assert getattr(shards, block) == getattr(tiny, block), block
    assert dataclasses.replace(shards, stream=tiny.stream) == tiny
    assert shards.stream.write_shards and not tiny.stream.write_shards
    assert all_recipes()["otcclip-shards-tiny"].claims() == all_recipes()["otcclip-mosaic-tiny"].claims()
