"""Every YAML in conf/ and recipes/ composes against the schema; every recipe's size matches its name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lightning_smartinf.cli.config import TrainConfig, register_configs
from lightning_smartinf.models.gpt import GPT
from lightning_smartinf.resources import asset_dir

register_configs()
RECIPES = sorted(p.stem for p in asset_dir("recipes").glob("*.yaml"))
GROUP_OPTIONS = sorted(
    (p.parent.name, p.stem) for p in asset_dir("conf").glob("*/*.yaml") if p.read_text().find("???") < 0
)


def compose_with(*overrides: str) -> TrainConfig:
    with initialize_config_dir(str(asset_dir("conf")), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def nominal_params(name: str) -> float:
    size = re.search(r"gpt_(\d+)_?(\d*)([mb])", name)
    assert size, name
    value = float(f"{size.group(1)}.{size.group(2) or 0}")
    return value * (1e6 if size.group(3) == "m" else 1e9)


PUBLISHED = {
    "llama3_1b": 1.236e9, "llama3_8b": 8.030e9, "llama3_70b": 70.554e9, "qwen2_5_0_5b": 0.494e9,
    "qwen2_5_7b": 7.616e9, "qwen2_5_72b": 72.706e9, "mistral_7b": 7.242e9, "mixtral_8x7b": 46.703e9,
}
"""Today's architectures: parameter counts of the published models (their model cards and safetensors indexes)."""


def test_recipe_list_is_complete() -> None:
    expected = {"gpt_tiny", "gpt_125m", "gpt_350m", "gpt_760m", "gpt_1_3b", "gpt_2_7b", "gpt_6_7b", "gpt_13b",
                "gpt_30b", "gpt_65b", "gpt_175b", *PUBLISHED}  # fmt: skip
    assert set(RECIPES) == expected


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_architecture_recipe_builds_on_meta_with_the_published_size(recipe: str) -> None:
    """Composed, its Hugging Face config built, the model made on meta (no weights): within 1% of the model card."""
    from lightning_smartinf.ecosystem.hf import build_model, load_config

    cfg = compose_with(f"recipe={recipe}")
    assert cfg.model.kind == "hf" and cfg.recipe_name == recipe
    config = load_config(None, cfg.model.config)
    with torch.device("meta"):
        model = build_model(config)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / PUBLISHED[recipe] - 1) < 0.01, f"{recipe}: {count:,}"


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.startswith("gpt_") and r != "gpt_tiny"])
def test_recipe_parameter_count_within_3_percent(recipe: str) -> None:
    cfg = compose_with(f"recipe={recipe}")
    with torch.device("meta"):
        model = GPT(cfg.model)
    count = sum(p.numel() for p in model.parameters())
    assert count == cfg.model.num_params()
    assert abs(count / nominal_params(recipe) - 1) < 0.03, f"{recipe}: {count:,}"


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = compose_with(f"{group}={option}")
    assert cfg.recipe_name == "gpt_tiny"


def test_bad_key_and_type_name_the_key() -> None:
    with pytest.raises(ConfigCompositionException, match="offload.bogus"):
        compose_with("offload.bogus=1")
    with pytest.raises(ConfigCompositionException, match="offload.prefetch"):
        compose_with("offload.prefetch=many")
    with pytest.raises(ConfigCompositionException, match="recipe"):
        compose_with("recipe=gpt_9000b")


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ValueError, match="offload.grads='ssd'"):
        compose_with("offload.grads=ssd")


def test_assets_are_packaged_next_to_the_package() -> None:
    for name in ("conf", "recipes"):
        assert (asset_dir(name) / ".").is_dir()
    assert Path(asset_dir("conf"), "config.yaml").is_file()
