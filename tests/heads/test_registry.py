"""The head registry, save format and load-time validation."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.heads import HeadShapeError, get_head_class, head_types, load_head
from specdec.heads.base import DraftHead


def test_registry_finds_heads_by_module_name():
    types = head_types()
    assert {"eagle", "eagle3"} <= set(types)
    for name in types:
        cls = get_head_class(name)
        assert issubclass(cls, DraftHead) and cls.head_type() == name
        assert dataclasses.is_dataclass(cls.Config)
    assert "base" not in types and "tree" not in types and "layers" not in types


def test_unknown_head_type_lists_known_ones():
    with pytest.raises(KeyError, match="unknown head type 'nope'.*eagle3"):
        get_head_class("nope")
    with pytest.raises(KeyError):
        get_head_class("base")


def test_unknown_config_field_is_named(tiny_target):
    with pytest.raises(ValueError, match="unknown eagle head field.*'hiden_size'"):
        get_head_class("eagle").from_target(tiny_target, hiden_size=3)


def test_saved_folder_holds_trainable_weights_under_engine_names(tiny_target, tmp_path):
    get_head_class("eagle").from_target(tiny_target).save_pretrained(tmp_path / "e1")
    get_head_class("eagle3").from_target(tiny_target).save_pretrained(tmp_path / "e3")
    cfg = json.loads((tmp_path / "e1" / "config.json").read_text())
    assert cfg["head_type"] == "eagle" and cfg["hidden_size"] == 64
    assert cfg["target"] == tiny_target.identity()
    e1 = load_file(str(tmp_path / "e1" / "model.safetensors"))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} <= set(e1)
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in e1)      # frozen copies
    assert "layers.0.input_layernorm.weight" not in e1                         # EAGLE-1 layer 0
    e3 = load_file(str(tmp_path / "e3" / "model.safetensors"))
    assert set(e3) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert e3["fc.weight"].shape == (64, 3 * 64)
    assert e3["layers.0.self_attn.q_proj.weight"].shape == (64, 2 * 64)


def test_load_without_target_loads_weights_but_cannot_run(tiny_target, tmp_path):
    head = get_head_class("eagle").from_target(tiny_target)
    head.save_pretrained(tmp_path / "h")
    bare = load_head(tmp_path / "h")
    assert torch.equal(bare.fc.weight, head.fc.weight)
    with pytest.raises(RuntimeError, match="without its target"):
        bare.new_drafter(None)


def test_head_for_another_target_is_refused(tiny_target, tmp_path):
    from specdec.infer.target import load_target
    from specdec.infer.tiny import build_tiny_target

    small = load_target(str(build_tiny_target(tmp_path / "t32", hidden_size=32, intermediate_size=64)))
    get_head_class("eagle").from_target(tiny_target).save_pretrained(tmp_path / "h64")
    with pytest.raises(HeadShapeError, match="hidden_size=64.*hidden_size=32"):
        load_head(tmp_path / "h64", small)
    # Without a recorded identity the config fields are still checked against the target.
    cfg = json.loads((tmp_path / "h64" / "config.json").read_text())
    cfg["target"] = None
    (tmp_path / "h64" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HeadShapeError, match="hidden_size: the head has 64, target .* has 32"):
        load_head(tmp_path / "h64", small)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.__setitem__("fc.weight", torch.zeros(64, 100)),
     r"fc.weight has shape \(64, 100\) in the checkpoint but the head expects \(64, 128\)"),
    (lambda t: t.pop("layers.0.mlp.up_proj.weight"), r"missing tensor layers.0.mlp.up_proj.weight"),
    (lambda t: t.__setitem__("extra.weight", torch.zeros(2)), r"unexpected tensor extra.weight"),
])
def test_bad_checkpoint_tensor_is_named(tiny_target, tmp_path, edit, message):
    get_head_class("eagle").from_target(tiny_target).save_pretrained(tmp_path / "h")
    path = tmp_path / "h" / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))
    with pytest.raises(HeadShapeError, match=message):
        load_head(tmp_path / "h", tiny_target)


def test_export_formats_include_own_format(tiny_target, tmp_path):
    head = get_head_class("eagle3").from_target(tiny_target)
    assert "specdec" in head.export_formats()
    head.export("specdec", tmp_path / "x")
    assert load_head(tmp_path / "x", tiny_target).config == head.config
    with pytest.raises(ValueError, match="cannot be exported as 'nope'"):
        head.export("nope", tmp_path / "y")
