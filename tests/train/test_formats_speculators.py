"""Opt-in (``make test-formats``): the `speculators` package loads and validates our EAGLE-3
exports on CPU.

speculators 0.9.0 pins transformers<=5.19 and datasets<=5.1, so it gets its own venv under
.cache/venv-speculators, built once by `python3 -m venv` + `pip install torch==2.13.0
speculators==0.9.0`; its PyPI torchvision / torchaudio wheels do not match the CPU torch and
break `import transformers` (RuntimeError: operator torchvision::nms does not exist), and
nothing here needs them, so they are uninstalled.

* `speculators convert SGLANG_EXPORT --algorithm eagle3 --verifier TARGET --validate-device cpu`
  reads our SGLang / EAGLE-3-reference export (`LlamaForCausalLMEagle3`, midlayer.*), converts it
  and validates the result by loading it;
* `SpeculatorModel.from_pretrained(VLLM_EXPORT)` loads our vLLM / speculators export directly;
  every tensor must arrive unchanged (speculators fills unloaded weights with NaN);
* a negative control: a wrong-shaped tensor makes speculators fail.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.formats

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".cache" / "venv-speculators"
READY = VENV / ".specdec-ready"
INSTALL = ["torch==2.13.0", "speculators==0.9.0"]


def speculators_venv() -> Path:
    """The venv's bin/ (built on first use; a half-built one is rebuilt)."""
    if READY.exists():
        return VENV / "bin"
    shutil.rmtree(VENV, ignore_errors=True)
    steps = [["python3", "-m", "venv", str(VENV)],
             [str(VENV / "bin" / "pip"), "install", "-q", INSTALL[0]],   # CPU torch first
             [str(VENV / "bin" / "pip"), "install", "-q", *INSTALL],
             [str(VENV / "bin" / "pip"), "uninstall", "-y", "-q", "torchvision", "torchaudio"],
             [str(VENV / "bin" / "python"), "-c", "from speculators import SpeculatorModel"]]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            pytest.fail(f"building {VENV} failed at {' '.join(cmd)}:\n{proc.stderr[-3000:]}")
    READY.touch()
    return VENV / "bin"


def run_in_venv(args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def exports(tmp_path_factory, smollm2):
    """An EAGLE-3 head on SmolLM2-135M (random weights, a draft vocab from token counts), saved
    by save_pretrained and exported as speculators/vLLM and as SGLang."""
    from specdec.heads.eagle3 import Eagle3Head
    from specdec.train.export import export_head

    torch.manual_seed(0)
    head = Eagle3Head.from_target(smollm2, draft_vocab_size=2048)
    text = "Speculative decoding drafts tokens that the target model then verifies. " * 8
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    counts = Eagle3Head.count_tokens([ids], [[1] * len(ids)], smollm2.vocab_size)
    counts = counts * 1000 + torch.randint(0, 1000, counts.shape)   # distinct, text tokens first
    head.set_draft_vocab(counts)
    root = tmp_path_factory.mktemp("speculators")
    head.save_pretrained(root / "head")
    verifier = str(Path(smollm2.path).resolve())
    out = {fmt: export_head(root / "head", fmt, root / fmt, target=smollm2, verifier=verifier)
           for fmt in ("speculators", "sglang")}
    return {"root": root, "head": head, "verifier": verifier, **out}


def test_speculators_convert_validates_our_sglang_export(exports):
    bin_ = speculators_venv()
    converted = exports["root"] / "converted"
    aux = exports["head"].config.aux_layers
    proc = run_in_venv([str(bin_ / "speculators"), "convert", str(exports["sglang"]),
                        "--algorithm", "eagle3", "--verifier", exports["verifier"],
                        "--output-path", str(converted), "--validate-device", "cpu",
                        "--algorithm-kwargs", json.dumps({"eagle_aux_hidden_state_layer_ids": aux})])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Validation succeeded" in proc.stderr + proc.stdout
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["draft_vocab_size"] == exports["head"].config.draft_vocab_size
    # speculators' own conversion of our SGLang folder holds exactly our weights
    from safetensors.torch import load_file

    theirs = {}
    for f in converted.glob("*.safetensors"):
        theirs.update(load_file(str(f)))
    ours = load_file(str(exports["speculators"] / "model.safetensors"))
    for name, t in ours.items():
        assert name in theirs, f"speculators' conversion lacks {name}"
        assert torch.equal(theirs[name].to(t.dtype), t), name


LOAD_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from safetensors.torch import load_file
    from speculators import SpeculatorModel
    model = SpeculatorModel.from_pretrained(sys.argv[1])
    sd = model.state_dict()
    ours = load_file(sys.argv[1] + "/model.safetensors")
    report = {"class": type(model).__name__,
              "missing": sorted(set(ours) - set(sd)),
              "mismatch": sorted(k for k, v in ours.items() if k in sd and not torch.equal(sd[k].to(v.dtype), v)),
              "nan": sorted(k for k, v in sd.items() if v.is_floating_point() and torch.isnan(v).any()
                            and not k.startswith(("embed_tokens", "verifier_"))),
              "aux": list(model.config.eagle_aux_hidden_state_layer_ids),
              "draft_vocab_size": model.config.draft_vocab_size,
              "norm_before_residual": model.config.norm_before_residual,
              "verifier": model.config.speculators_config.verifier.name_or_path}
    print("REPORT " + json.dumps(report))
""")


def _load_report(bin_: Path, folder: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = run_in_venv([str(bin_ / "python"), "-c", LOAD_SCRIPT, str(folder)])
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    return proc, (json.loads(line[-1][7:]) if line else None)


def test_speculator_model_loads_our_vllm_export(exports):
    bin_ = speculators_venv()
    proc, report = _load_report(bin_, exports["speculators"])
    assert proc.returncode == 0 and report, proc.stderr[-4000:]
    c = exports["head"].config
    assert report["class"] == "Eagle3DraftModel"
    assert report["missing"] == [] and report["mismatch"] == [] and report["nan"] == [], report
    assert report["aux"] == list(c.aux_layers)
    assert report["draft_vocab_size"] == c.draft_vocab_size
    assert report["norm_before_residual"] == c.norm_before_residual
    assert report["verifier"] == exports["verifier"]


def test_speculators_refuses_a_wrong_shape(exports, tmp_path):
    """Negative control: the checks above can fail. A draft LM head one row short must not load."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(exports["speculators"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:-1].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc, report = _load_report(speculators_venv(), bad)
    assert proc.returncode != 0 or report is None or report["mismatch"] or report["nan"], report
