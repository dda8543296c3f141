"""The distribution installs only under `specdec/`, and every console script answers --help."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["specdec-train", "specdec-data", "specdec-export", "specdec-push",
           "specdec-generate", "specdec-bench", "specdec-serve"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(REPO)], check=True)
    return next(out.glob("specdec-*.whl"))


def test_wheel_has_only_the_specdec_namespace(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"specdec"}, top
    # The three packages, the recipes and the CPU kernels' sources (as package data) are inside it.
    for must in ("specdec/heads/__init__.py", "specdec/train/__init__.py",
                 "specdec/infer/__init__.py", "specdec/recipes/smollm2-135m/eagle3.yaml",
                 "specdec/infer/models/attention_cpu.cpp", "specdec/infer/models/glue_cpu.cpp",
                 "specdec/infer/models/linear_bf16_cpu.cpp"):
        assert must in names, must
    assert not any(n.startswith("specdec/__init__") for n in names), "specdec must stay a namespace"


def test_wheel_declares_every_console_script(wheel):
    with zipfile.ZipFile(wheel) as zf:
        entry = next(n for n in zf.namelist() if n.endswith("entry_points.txt"))
        text = zf.read(entry).decode()
    for script in SCRIPTS:
        assert f"{script} = specdec." in text


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help_explains(script):
    exe = Path(sys.executable).parent / script
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower() and len(out.stdout) > 200
