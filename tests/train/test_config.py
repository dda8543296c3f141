"""Recipes: strict typed loading, errors that name key and line, overrides, resolved dump."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from specdec.train.config import RecipeError, load_recipe, parse_recipe, split_loss

REPO = Path(__file__).resolve().parents[2]

GOOD = """\
target:
  name: tiny-llama
head:
  type: eagle3
  ttt_steps: 3
data:
  files: [bundled:sharegpt_dummy]
  regenerate:
    enabled: true
    num_prompts: 10
optim:
  lr: 1e-4
  betas: [0.9, 0.99]
  warmup: 0.1
output:
  dir: runs/x
"""


class KwargHead(torch.nn.Module):
    """A stand-in head whose loss takes a keyword weight (no registered head does)."""

    @dataclass
    class Config:
        depth: int = 2
        decay: float = 0.8

    def loss(self, batch, label_smoothing: float = 0.0):
        return torch.zeros(()), {}


def test_good_recipe_is_typed():
    r = parse_recipe(GOOD, "good.yaml")
    assert r.target.name == "tiny-llama"
    assert r.head.type == "eagle3" and r.head.fields == {"ttt_steps": 3}
    assert r.optim.lr == pytest.approx(1e-4) and isinstance(r.optim.lr, float)  # YAML 1.1 reads 1e-4 as str
    assert r.optim.betas == (0.9, 0.99)
    assert r.optim.warmup == 0.1 and isinstance(r.optim.warmup, float)
    assert r.data.regenerate.enabled is True and r.data.regenerate.num_prompts == 10
    assert r.deepspeed.zero_stage == 0 and r.wandb.mode == "auto"  # defaults


@pytest.mark.parametrize("text, key", [
    (GOOD.replace("  lr: 1e-4", "  lrr: 1e-4"), "optim.lrr"),                      # unknown key
    (GOOD.replace("  lr: 1e-4", "  lr: fast"), "optim.lr"),                         # wrong type
    (GOOD.replace("    num_prompts: 10", "    num_prompt: 10"), "data.regenerate.num_prompt"),
    (GOOD.replace("  ttt_steps: 3", "  ttt_steps: three"), "head.ttt_steps"),        # head Config type
    (GOOD.replace("  ttt_steps: 3", "  ttt_stepz: 3"), "head.ttt_stepz"),            # head Config key
    (GOOD.replace("  betas: [0.9, 0.99]", "  betas: [0.9]"), "optim.betas"),        # tuple length
    (GOOD.replace("  dir: runs/x", "  dir: runs/x\n  save_evry: 5"), "output.save_evry"),
    (GOOD + "deepspeed:\n  zero_stage: 7\n", "deepspeed.zero_stage"),               # range
    (GOOD.replace("  lr: 1e-4", "  lr: 1e-4\n  max_minutes: 0"), "optim.max_minutes"),  # range
    (GOOD.replace("  lr: 1e-4", "  lr: 1e-4\n  max_minutes: soon"), "optim.max_minutes"),
    (GOOD + "extra_section: 1\n", "extra_section"),
    (GOOD + "loss:\n  nonsense_weight: 1.0\n", "loss.nonsense_weight"),
])
def test_bad_key_names_key_and_line(text, key):
    leaf = key.rsplit(".", 1)[-1]
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.strip().startswith(leaf + ":"))
    with pytest.raises(RecipeError) as err:
        parse_recipe(text, "bad.yaml")
    assert str(err.value).startswith(f"bad.yaml:{line}: {key}:")


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(RecipeError, match="did you mean 'lr'"):
        parse_recipe(GOOD.replace("  lr: 1e-4", "  lrr: 1e-4"), "bad.yaml")


def test_unknown_head_type_lists_the_registered_ones():
    with pytest.raises(RecipeError, match=r"bad.yaml:4: head.type: .*eagle3"):
        parse_recipe(GOOD.replace("type: eagle3", "type: eagle9"), "bad.yaml")


def test_overrides_are_typed_by_the_field():
    r = parse_recipe(GOOD, "good.yaml", overrides=[
        "optim.lr=3e-4", "optim.max_steps=7", "head.ttt_steps=5", "data.regenerate.enabled=false",
        "wandb.tags=[a, b]", "deepspeed.extra={gradient_clipping: 0.5}", "data.limit=null",
        "optim.warmup=10"])
    assert r.optim.lr == pytest.approx(3e-4) and r.optim.max_steps == 7
    assert r.head.fields["ttt_steps"] == 5 and r.data.regenerate.enabled is False
    assert r.wandb.tags == ["a", "b"] and r.deepspeed.extra == {"gradient_clipping": 0.5}
    assert r.data.limit is None
    assert r.optim.warmup == 10 and isinstance(r.optim.warmup, int)  # int = steps, float = share


def test_override_creates_missing_sections():
    r = parse_recipe("head: {type: eagle3}\n", "min.yaml", overrides=["deepspeed.zero_stage=2"])
    assert r.deepspeed.zero_stage == 2


@pytest.mark.parametrize("override, key", [("optim.lr=abc", "optim.lr"), ("optim.nope=1", "optim.nope"),
                                           ("head.ttt_steps=1.5", "head.ttt_steps"), ("novalue", "")])
def test_bad_override_is_named(override, key):
    with pytest.raises(RecipeError) as err:
        parse_recipe(GOOD, "good.yaml", overrides=[override])
    assert f"override {override!r}" in str(err.value) and key in str(err.value)


def test_loss_section_takes_config_weights_and_loss_kwargs():
    r = parse_recipe(GOOD + "loss:\n  step_decay: 0.5\n", "good.yaml")  # an eagle3 Config field
    from specdec.heads import get_head_class

    assert split_loss(get_head_class("eagle3"), r.loss) == ({"step_decay": 0.5}, {})
    text = "head: {type: stub}\nloss:\n  label_smoothing: 0.1\n  decay: 0.5\n"
    r = parse_recipe(text, "stub.yaml", head_resolver=lambda name: KwargHead)
    assert split_loss(KwargHead, r.loss) == ({"decay": 0.5}, {"label_smoothing": 0.1})
    with pytest.raises(RecipeError, match=r"stub.yaml:3: loss.label_smoothing: expected float"):
        parse_recipe(text.replace("0.1", "lots"), "stub.yaml", head_resolver=lambda name: KwargHead)
    with pytest.raises(RecipeError, match="also set as head.decay"):
        parse_recipe("head: {type: stub, decay: 0.1}\nloss: {decay: 0.5}\n", "stub.yaml",
                     head_resolver=lambda name: KwargHead)


def test_resolved_dump_round_trips(tmp_path):
    r = parse_recipe(GOOD, "good.yaml", overrides=["optim.max_steps=9"])
    path = r.dump(tmp_path / "recipe.resolved.yaml")
    again = load_recipe(path)
    assert again.to_dict() == r.to_dict()
    data = yaml.safe_load(path.read_text())
    assert data["optim"]["max_steps"] == 9 and data["optim"]["schedule"] == "cosine"  # defaults filled


def test_cli_rejects_bad_recipe_before_any_work(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD.replace("  lr: 1e-4", "  lr: [1]"))
    proc = subprocess.run([sys.executable, "-m", "specdec.train.cli", str(bad), f"output.dir={tmp_path}/out"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}:12: optim.lr: expected float" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


def test_cli_help_explains_sections_and_overrides():
    from specdec.train.cli import build_parser

    text = build_parser().format_help()
    for word in ("target:", "head:", "data:", "loss:", "optim:", "output:", "deepspeed:", "wandb:",
                 "overrides", "--no-resume", "micro_batch_size", "zero_stage"):
        assert word in text


def test_a_missing_data_file_is_named_at_its_line_before_any_work(tmp_path):
    """The command line checks data.files (a run would load the target first); library
    loading does not, so a recipe for files on another machine still parses."""
    text = GOOD.replace("[bundled:sharegpt_dummy]", "[bundled:sharegpt_dummy, nope.jsonl]")
    assert parse_recipe(text, name="r.yaml").data.files[1] == "nope.jsonl"
    with pytest.raises(RecipeError, match=r"^r\.yaml:7: data\.files\[1\]: no such file 'nope\.jsonl'"):
        parse_recipe(text, name="r.yaml", check_files=True)
    with pytest.raises(RecipeError, match=r"^r\.yaml:7: data\.files\[0\]: unknown bundled set 'bundled:gsm8"):
        parse_recipe(GOOD.replace("sharegpt_dummy", "gsm8"), name="r.yaml", check_files=True)
    with pytest.raises(RecipeError, match=r"^override 'data\.files=\[x\.json\]': data\.files\[0\]"):
        parse_recipe(GOOD, overrides=["data.files=[x.json]"], check_files=True)
    real = tmp_path / "mine.jsonl"
    real.write_text("")
    parse_recipe(GOOD.replace("bundled:sharegpt_dummy", str(real)), check_files=True)


def test_an_empty_output_dir_or_target_name_is_refused():
    """`output.dir=` (a slip on the command line) would train into the current folder."""
    with pytest.raises(RecipeError, match=r"^override 'output\.dir=': output\.dir: must not be empty"):
        parse_recipe(GOOD, overrides=["output.dir="])
    with pytest.raises(RecipeError, match=r"target\.name: must not be empty"):
        parse_recipe(GOOD, overrides=["target.name=''"])
