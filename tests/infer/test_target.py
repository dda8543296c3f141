"""Target loading: folders, clear resolve errors, and the embedded GGUF conversion is exact."""
from __future__ import annotations

import pytest
import torch

from specdec.infer.target import TargetError, load_target, resolve_device, resolve_target


def test_auto_device_is_cuda_only_where_a_gpu_is_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    with pytest.raises(TargetError, match="use --device cpu"):
        resolve_device("cuda:1")
    with pytest.raises(TargetError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"


def test_tiny_target_from_a_folder(tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    assert (target.hidden_size, target.num_layers, target.vocab_size) == (64, 4, 320)
    im_end = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert target.eos_token_ids == [im_end]
    assert target.chat_template and "<|im_start|>" in target.chat_template
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())
    # The identity is a property of the weights, stable across loads.
    assert load_target(str(tiny_target_dir)).identity() == target.identity()
    assert target.identity()["hidden_size"] == 64


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_where_the_device_computes_it(monkeypatch, tiny_target_dir, native):
    """``auto`` (recipes, --dtype) must not pick bf16 on a CPU that emulates it (4.7x slower)."""
    from specdec.infer import dtypes
    from specdec.infer.runner import TargetRunner
    from specdec.train.config import Recipe
    from specdec.train.trainer import use_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    want = torch.bfloat16 if native else torch.float32
    assert dtypes.native_bf16("cpu") is native
    assert dtypes.dtype_name("auto") == str(want).removeprefix("torch.")
    assert dtypes.dtype_name("bf16") == "bfloat16"  # aliases pass through, spelled out
    target = load_target(str(tiny_target_dir), dtype="auto")
    assert next(target.model.parameters()).dtype == want
    assert TargetRunner(target, max_batch=1, max_len=8, dtype="auto").dtype == want
    recipe = Recipe()
    assert recipe.deepspeed.precision == "auto"
    assert use_bf16(recipe, torch.device("cpu")) is native
    with pytest.raises(ValueError, match="unknown dtype 'int8'; use one of auto, float32"):
        dtypes.torch_dtype("int8")


@pytest.mark.parametrize("kernel", [True, False])
def test_auto_for_decoding_is_bf16_where_the_avx2_kernel_runs(monkeypatch, tiny_target_dir, kernel):
    """The runtime's ``auto`` also picks bf16 on a CPU without native bf16 that runs specdec's AVX2
    bf16 linear kernel (decoding is memory-bound: half the bytes); training's ``auto`` does not."""
    from specdec.infer import dtypes
    from specdec.infer.api import LLM
    from specdec.infer.models import linear

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(linear.BF16_KERNEL, "get", lambda: object() if kernel else None)
    want = "bfloat16" if kernel else "float32"
    assert dtypes.dtype_name("auto", "cpu", decoding=True) == want
    assert dtypes.dtype_name("auto", "cpu") == "float32"  # recipes: capture and training
    assert dtypes.dtype_name("float32", "cpu", decoding=True) == "float32"  # explicit names stay
    llm = LLM(str(tiny_target_dir), dtype="auto", max_batch=1, max_len=32)
    assert next(llm.target.model.parameters()).dtype == getattr(torch, want)


def test_identity_tells_different_weights_apart(tmp_path, tiny_target):
    from specdec.infer.tiny import build_tiny_target

    other = load_target(str(build_tiny_target(tmp_path / "t", seed=1)))
    assert other.identity()["fingerprint"] != tiny_target.identity()["fingerprint"]


def test_identity_is_the_same_in_fp32_and_bf16(tiny_target_dir, tiny_target):
    # A head trained on the fp32 target and served in bf16 (`--dtype auto`) must not warn.
    in_bf16 = load_target(str(tiny_target_dir), dtype=torch.bfloat16)
    assert in_bf16.identity() == tiny_target.identity()


def test_resolve_errors_are_clear(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target(str(tmp_path / "missing" / "model"))
    with pytest.raises(TargetError, match="does not exist"):
        resolve_target(str(tmp_path / "model.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetError, match="has no config.json"):
        resolve_target(str(tmp_path / "empty"))
    with pytest.raises(TargetError, match="unknown target 'nonsense'"):
        resolve_target("nonsense")


@pytest.mark.e2e
def test_smollm2_reports_its_shape(smollm2):
    assert (smollm2.hidden_size, smollm2.num_layers, smollm2.vocab_size) == (576, 30, 49152)
    assert smollm2.eos_token_ids == [2]


@pytest.mark.e2e
def test_converted_folder_equals_the_gguf(smollm2):
    """The safetensors folder we convert to gives the GGUF's own logits (fp32)."""
    from specdec.infer.target import embedded_gguf

    gguf = embedded_gguf("smollm2-135m")  # kept in the cache beside the converted folder
    assert gguf.parent == smollm2.path.parent
    direct = load_target(str(gguf), dtype=torch.float32)
    text = smollm2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three prime numbers."}], tokenize=False,
        add_generation_prompt=True)
    ids = smollm2.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert direct.tokenizer(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        a = smollm2.model(input_ids=ids).logits
        b = direct.model(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
