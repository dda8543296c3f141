"""Run logging: ``<output.dir>/metrics.jsonl`` + Weights & Biases (offline unless logged in)."""
from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from .config import Recipe
from .evaluate import EvalResult


def wandb_mode(configured: str) -> str:
    """auto -> $WANDB_MODE if set, else online when logged in, else offline (never blocks)."""
    if configured != "auto":
        return configured
    env = os.environ.get("WANDB_MODE")
    if env:
        return env
    return "online" if _wandb_logged_in() else "offline"


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class RunLogger:
    """``<output.dir>/metrics.jsonl`` (one JSON line per logged step / eval) + wandb, rank 0 only.

    On resume from step S the lines a killed run wrote after S are dropped, so the file always
    reads as one uninterrupted run; the wandb run id is kept in the output dir and reused.
    """

    def __init__(self, recipe: Recipe, is_main: bool, resume_step: int = 0, finished: bool = False):
        self.is_main = is_main
        self.out = Path(recipe.output.dir)
        self.path = self.out / "metrics.jsonl"
        self.run = None
        if not is_main:
            return
        self._truncate(resume_step, finished)
        mode = wandb_mode(recipe.wandb.mode)
        if mode != "disabled":
            self.run = self._init_wandb(recipe, mode)

    def _truncate(self, resume_step: int, finished: bool) -> None:
        """Keep what the resumed state already contains; a finished run re-runs its final eval."""
        if not self.path.exists():
            return

        def wanted(row: dict) -> bool:
            step = row.get("step", 0)
            return step < resume_step or step == resume_step and not (finished and row["kind"] == "eval")

        kept = [line for line in self.path.read_text().splitlines() if line.strip() and wanted(json.loads(line))]
        self.path.write_text("".join(line + "\n" for line in kept))

    def _init_wandb(self, recipe: Recipe, mode: str):
        import wandb

        id_file = self.out / "wandb-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        id_file.write_text(run_id + "\n")
        w = recipe.wandb
        kwargs = dict(project=w.project, name=w.name or self.out.name, entity=w.entity,
                      tags=list(w.tags) or None, dir=str(self.out), config=recipe.to_dict(),
                      id=run_id, resume="allow")
        try:
            return wandb.init(mode=mode, **kwargs)
        except Exception as err:  # noqa: BLE001 - a logging backend must not kill training
            print(f"wandb {mode} failed ({err}); logging offline instead", file=sys.stderr)
            return wandb.init(mode="offline", **kwargs)

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log_train(self, record: dict) -> None:
        if not self.is_main:
            return
        self._write({"kind": "train", **record})
        if self.run is not None:
            self.run.log({f"train/{k}": v for k, v in record.items() if k != "step"}, step=record["step"])

    def log_eval(self, step: int, result: EvalResult) -> None:
        if not self.is_main:
            return
        flat = result.flat_metrics()
        self._write({"kind": "eval", "step": step, **flat})
        if self.run is not None:
            self.run.log(flat, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
