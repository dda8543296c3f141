"""Every recipe under recipes/ parses and validates against its head; the sets are complete."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.heads import head_types
from specdec.train.config import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FILES = sorted(RECIPES.rglob("*.yaml"))


def test_there_are_recipes():
    assert len(FILES) >= 3


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(RECIPES)) for p in FILES])
def test_recipe_validates(path):
    recipe = load_recipe(path)  # strict: unknown keys, wrong types and head fields all fail here
    assert recipe.head.type in head_types()
    assert recipe.output.dir.startswith("runs/")  # relative to the repo, never a personal path
    if path.parent.name == "tiny":
        assert recipe.target.name == "tiny-llama"
        assert recipe.optim.max_steps is not None and recipe.optim.max_steps <= 50
        assert not recipe.data.regenerate.enabled  # tiny runs must stay under a minute
    if path.parent.name == "smollm2-135m":
        assert recipe.target.name == "smollm2-135m"
        assert recipe.optim.max_steps is not None  # a bounded CPU budget, not open-ended epochs
        assert f"/{path.stem}" in recipe.output.dir


@pytest.mark.parametrize("folder", ["tiny", "smollm2-135m"])
def test_every_head_type_has_a_recipe(folder):
    have = {p.stem for p in (RECIPES / folder).glob("*.yaml")}
    assert set(head_types()) <= have, sorted(set(head_types()) - have)


def test_gpu_recipe_and_hostfile():
    recipe = load_recipe(RECIPES / "gpu" / "llama-3.1-8b-instruct-eagle3.yaml")
    assert recipe.head.fields["ttt_steps"] == 7 and recipe.head.fields["draft_vocab_size"] == 32000
    assert recipe.deepspeed.precision == "bf16" and recipe.data.max_length == 2048
    assert recipe.data.mode == "online" and recipe.optim.lr == pytest.approx(1e-4)
    hosts = [line for line in (RECIPES / "gpu" / "hostfile.example").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert hosts and all(re.fullmatch(r"\S+ slots=\d+", line) for line in hosts)
