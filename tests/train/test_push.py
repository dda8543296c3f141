"""specdec-push against a local HTTP stand-in for the Hugging Face Hub (HF_ENDPOINT).

The app answers the calls an upload makes (huggingface_hub 2.x): POST /api/repos/create,
POST /api/validate-yaml (the client checks a README.md's metadata before committing it),
POST /api/models/{ns}/{name}/preupload/{rev} (every file "regular", i.e. sent inline),
POST /api/models/{ns}/{name}/commit/{rev} (NDJSON: a header line, then one line per file with
base64 content) and POST /api/models/{ns}/{name}/branch/{rev}, and records what arrives. Failures: the commit answering 500, a closed port,
HF_HUB_OFFLINE=1. The local export must be byte-identical afterwards.
"""
from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from specdec.train.push import main


class FakeHub:
    """Records requests; `fail_commit` makes the commit endpoint answer 500."""

    def __init__(self):
        self.requests: list[tuple[str, str]] = []
        self.created: list[dict] = []
        self.commits: list[dict] = []
        self.cards: list[str] = []
        self.fail_commit = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _reply(self, code: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.requests.append(("POST", self.path))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    hub.created.append(req)
                    return self._reply(200, {"url": f"{hub.url}/{req['organization']}/{req['name']}"})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                        "shouldIgnore": False} for f in files]})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                    if hub.fail_commit:
                        return self._reply(500, {"error": "storage backend is down"})
                    lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
                    files = {ln["value"]["path"]: base64.b64decode(ln["value"]["content"])
                             for ln in lines if ln["key"] == "file"}
                    header = next(ln["value"] for ln in lines if ln["key"] == "header")
                    hub.commits.append({"repo": "/".join(parts[2:4]), "revision": parts[5],
                                        "header": header, "files": files})
                    return self._reply(200, {"commitUrl": f"{hub.url}/{parts[2]}/{parts[3]}/commit/1",
                                             "commitOid": "1" * 40, "pullRequestUrl": None})
                if parts[:2] == ["api", "validate-yaml"]:   # the client checks the card's metadata
                    hub.cards.append(json.loads(body)["content"])
                    return self._reply(200, {"errors": [], "warnings": []})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "branch":
                    return self._reply(200, {})
                return self._reply(404, {"error": f"no route {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    h = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    yield h
    h.close()


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tiny_target):
    """A Medusa TGI export carrying eval.json and the resolved recipe (as specdec-export writes)."""
    from specdec.heads.medusa import MedusaHead
    from specdec.train.export import export_head

    root = tmp_path_factory.mktemp("push")
    torch.manual_seed(0)
    MedusaHead.from_target(tiny_target, num_heads=2).save_pretrained(root / "head")
    ev = {"step": 40, "depth": 2, "correct": [30, 12], "count": [60, 60], "reach": [0.5, 0.2],
          "acceptance": [0.5, 0.4], "tau": 1.7, "ece": 0.05, "num_sequences": 6}
    (root / "head" / "eval.json").write_text(json.dumps(ev))
    (root / "head" / "recipe.yaml").write_text(
        "target: {name: tiny-llama, dtype: float32}\nhead: {type: medusa, num_heads: 2}\n"
        "data: {files: ['bundled:gsm8k'], max_length: 256, limit: 8, regenerate: {enabled: true}}\n"
        "optim: {lr: 0.001, epochs: 1, max_steps: 40}\n")
    return export_head(root / "head", "tgi", root / "export", target=tiny_target,
                       verifier="acme/tiny-llama")


def folder_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def test_push_uploads_files_and_card(hub, export_dir, capsys):
    before = folder_hash(export_dir)
    assert main([str(export_dir), "--repo-id", "acme/tiny-medusa", "--private"]) == 0
    assert hub.created and hub.created[0]["name"] == "tiny-medusa"
    assert hub.created[0]["organization"] == "acme"
    assert hub.created[0].get("visibility", "private" if hub.created[0].get("private") else "") == "private"
    (commit,) = hub.commits
    assert commit["repo"] == "acme/tiny-medusa" and commit["revision"] == "main"
    for name in ("config.json", "medusa_lm_head.safetensors", "specdec.json", "eval.json",
                 "recipe.resolved.yaml"):
        assert commit["files"][name] == (export_dir / name).read_bytes(), name
    card = commit["files"]["README.md"].decode()
    assert "acme/tiny-medusa" in card                     # the usage snippet names the repo
    assert "| 1 | 0.500 | 0.500 | 30 / 60 |" in card      # the acceptance table
    assert "tau = 1.700" in card and "bundled:gsm8k" in card and "lr 0.001" in card
    assert "base_model: acme/tiny-llama" in card and "medusa" in commit["header"]["summary"]
    assert hub.cards == [card]                            # the card's metadata was validated
    assert folder_hash(export_dir) == before
    assert "uploaded" in capsys.readouterr().out


def test_push_to_a_branch(hub, export_dir):
    assert main([str(export_dir), "--repo-id", "acme/x", "--revision", "dev"]) == 0
    assert hub.commits[0]["revision"] == "dev"
    assert any("/branch/dev" in path for _, path in hub.requests)


def test_failed_commit_says_why_and_leaves_the_export(hub, export_dir, capsys):
    hub.fail_commit = True
    before = folder_hash(export_dir)
    assert main([str(export_dir), "--repo-id", "acme/x"]) == 1
    err = capsys.readouterr().err
    assert "HTTP 500" in err and "storage backend is down" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert folder_hash(export_dir) == before and not hub.commits


def test_unreachable_endpoint_fails_fast(monkeypatch, export_dir, capsys):
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = folder_hash(export_dir)
    assert main([str(export_dir), "--repo-id", "acme/x"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err
    assert folder_hash(export_dir) == before


def test_offline_mode_fails_at_once(monkeypatch, export_dir, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    assert main([str(export_dir), "--repo-id", "acme/x"]) == 1
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err


def test_bad_input_is_named(hub, tmp_path, export_dir, capsys):
    assert main([str(tmp_path), "--repo-id", "acme/x"]) == 1
    assert "no config.json" in capsys.readouterr().err
    assert main([str(export_dir), "--repo-id", "not-a-repo-id"]) == 1
    assert "ORG/NAME" in capsys.readouterr().err
    assert main([str(export_dir.parent / "head"), "--repo-id", "acme/x"]) == 1   # not exported yet
    assert "specdec-export" in capsys.readouterr().err
    assert not hub.requests
