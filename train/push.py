"""``specdec-push DIR --repo-id ORG/NAME``: upload an export (specdec-export) to the Hugging Face Hub.

One commit holds every file of the folder plus a model card rendered for the repo (target, data,
recipe, the measured per-depth acceptance and tau, the engine command with the repo id); the
local folder is only read. Honours HF_ENDPOINT (a mirror, or a local test server), HF_TOKEN and
HF_HUB_OFFLINE (which fails at once: uploads need the network).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_ENDPOINT = "https://huggingface.co"
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class PushError(RuntimeError):
    """The upload could not be made; the message says why and what to do."""


def hub_endpoint(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def check_reachable(endpoint: str, timeout: float = 5.0) -> None:
    """Fail in seconds, not after the hub client's retries, when the endpoint cannot be reached.
    Skipped behind a proxy (the client goes through it, a direct connection may not)."""
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise PushError(f"HF_ENDPOINT {endpoint!r} is not an http(s) URL")
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                                       "ALL_PROXY", "all_proxy")):
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout).close()
    except OSError as err:
        raise PushError(f"cannot reach {endpoint} ({err}): check the network, or set HF_ENDPOINT "
                        "to a reachable Hub mirror") from err


def upload_plan(folder: Path, repo_id: str) -> tuple[list[Path], bytes]:
    """The files to upload (all but hidden ones and README.md) and the model card's bytes."""
    from specdec.heads.export_common import CARD_FILE, PROVENANCE_FILE, render_model_card

    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CARD_FILE
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if (folder / PROVENANCE_FILE).exists():
        card = render_model_card(folder, location=repo_id)
    elif (folder / CARD_FILE).exists():
        card = (folder / CARD_FILE).read_text()
    else:
        card = f"# {repo_id}\n\nA speculative-decoding draft head uploaded with specdec-push.\n"
    return files, card.encode()


def _is_trainer_folder(folder: Path) -> bool:
    from specdec.heads.base import HEAD_FORMAT

    try:
        return json.loads((folder / "config.json").read_text()).get("format") == HEAD_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def push_export(folder, repo_id: str, *, private: bool = False, revision: str | None = None,
                token: str | None = None, endpoint: str | None = None) -> str:
    """Create `repo_id` (if needed) and commit the export in `folder` to it; returns the commit URL."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise PushError(f"{folder} is not an export folder (no config.json): run specdec-export first")
    if _is_trainer_folder(folder):  # specdec's own format: no engine loads it from the Hub
        raise PushError(f"{folder} is a head as specdec-train saves it, which vLLM, SGLang and TGI do "
                        f"not load: export it first (specdec-export {folder} --format vllm --out DIR) "
                        "and push DIR")
    if not REPO_ID.fullmatch(repo_id):
        raise PushError(f"--repo-id must look like ORG/NAME, got {repo_id!r}")
    if _offline():
        raise PushError("HF_HUB_OFFLINE is set: uploading needs the network. Unset HF_HUB_OFFLINE "
                        "(and point HF_ENDPOINT at a mirror if the Hub itself is not reachable)")
    endpoint = hub_endpoint(endpoint)
    check_reachable(endpoint)
    files, card = upload_plan(folder, repo_id)

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(endpoint=endpoint, token=token, library_name="specdec")
    ops = [CommitOperationAdd(path_in_repo=p.relative_to(folder).as_posix(), path_or_fileobj=str(p))
           for p in files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card))
    prov = _provenance(folder)
    message = (f"specdec: {prov.get('head_type', 'draft')} head in the "
               f"{prov.get('engine_format', '?')} format for {(prov.get('target') or {}).get('name', '?')}")
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        info = api.create_commit(repo_id, ops, commit_message=message, revision=revision,
                                 repo_type="model")
    except Exception as err:   # noqa: BLE001 - every failure becomes one readable line
        raise PushError(describe_failure(err, endpoint, repo_id)) from err
    return getattr(info, "commit_url", None) or f"{endpoint}/{repo_id}"


def _provenance(folder: Path) -> dict:
    try:
        return json.loads((folder / "specdec.json").read_text())
    except (OSError, ValueError):
        return {}


def describe_failure(err: Exception, endpoint: str, repo_id: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    where = f"uploading to {endpoint}/{repo_id} failed"
    if isinstance(err, OfflineModeIsEnabled):
        return f"{where}: HF_HUB_OFFLINE is set (unset it to upload)"
    if isinstance(err, HfHubHTTPError):
        status = getattr(err.response, "status_code", "?")
        try:
            url = err.response.request.url
        except (AttributeError, RuntimeError):   # a response built without its request
            url = endpoint
        detail = err.server_message or str(err).splitlines()[0]
        hint = {401: " (log in with `hf auth login` or pass --token / HF_TOKEN)",
                403: " (the token may not write to this namespace)"}.get(status, "")
        return f"{where}: HTTP {status} from {url}: {detail}{hint}"
    return f"{where}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec-push",
                                description="Upload a specdec-export folder to the Hugging Face Hub.")
    p.add_argument("folder", help="an export folder written by specdec-export")
    p.add_argument("--repo-id", required=True, help="ORG/NAME of the model repo (created if needed)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", default=None, help="branch to commit to (created if needed)")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN / `hf auth login`)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        prov = _provenance(Path(args.folder))
        verifier = prov.get("verifier", "")
        if verifier.startswith("/"):
            print(f"specdec-push: warning: the export names its verifier by a local path "
                  f"({verifier}); re-export with --verifier ORG/NAME so others can load it",
                  file=sys.stderr)
        url = push_export(args.folder, args.repo_id, private=args.private, revision=args.revision,
                          token=args.token)
    except PushError as err:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"specdec-push: error: {err}", file=sys.stderr)
        return 1
    print(f"specdec-push: uploaded {args.folder} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
