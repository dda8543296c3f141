"""Training checkpoints that survive SIGKILL: DeepSpeed state + data position + RNG states.

Layout under ``<output.dir>/checkpoints/``::

    step-00000040/            one DeepSpeed tag (model, optimizer, LR scheduler states)
        rng-rank0.pt          torch / CUDA / numpy / python RNG of each process
        trainer_state.json    {"step", "tokens", "epoch", ...} (the data position is the step)
        COMPLETE              written last, after every rank finished: only tags holding it
                              are ever resumed from, so a run killed mid-save falls back to
                              the previous checkpoint instead of loading half a file.

DeepSpeed's own ``latest`` file is written too but not trusted for the same reason.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
from pathlib import Path

import torch

COMPLETE = "COMPLETE"
TAG_RE = re.compile(r"^step-(\d{8})$")


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def complete_tags(output_dir: str | Path) -> list[tuple[int, str]]:
    """(step, tag) of every finished checkpoint, oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = TAG_RE.match(entry.name)
        if match and (entry / COMPLETE).exists():
            found.append((int(match.group(1)), entry.name))
    return sorted(found)


class ResumeError(RuntimeError):
    """A run cannot start or resume in its output.dir: another run holds it, no checkpoint where
    --resume insists on one, or one of another shape."""


LOCK_FILE = ".specdec-train.lock"


def lock_output_dir(output_dir: str | Path):
    """Hold output.dir for this run (the main process) until the returned file is closed or the
    process dies: two runs writing one folder's checkpoints would prune each other's."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    f = open(Path(output_dir) / LOCK_FILE, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise ResumeError(f"{output_dir} is in use by another specdec-train run ({owner}): let it "
                          "finish or stop it, or choose another output.dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def require_checkpoint(output_dir: str | Path) -> None:
    """--resume's check, made before any data work so that a wrong output.dir costs nothing."""
    if latest_checkpoint(output_dir) is None:
        raise ResumeError(f"--resume: no complete checkpoint under {checkpoint_root(output_dir)} "
                          "(drop --resume to start this run)")


def check_head_shapes(output_dir: str | Path, head) -> None:
    """Resuming into a head of other shapes (a head field, the head type or the target changed
    since the checkpoint) fails here, before any data work, naming the tensors that differ:
    a tensor only one side has would otherwise surface as the optimizer's bare "parameter
    group that doesn't match" after the capture."""
    tag = latest_checkpoint(output_dir)
    states = sorted((checkpoint_root(output_dir) / str(tag)).glob("*mp_rank_00_model_states.pt"))
    if tag is None or not states:  # no checkpoint, or a layout load_checkpoint checks
        return
    saved = _saved_shapes(states[0])
    frozen = {name for name, p in head.named_parameters() if not p.requires_grad}  # never saved
    mine = {name: tuple(t.shape) for name, t in head.state_dict().items() if name not in frozen}
    differ = [f"{name}: checkpoint {saved[name]}, recipe {shape}"
              for name, shape in mine.items() if name in saved and saved[name] != shape]
    differ += [f"{name}: not in the checkpoint" for name in mine if name not in saved]
    differ += [f"{name}: only in the checkpoint" for name in saved if name not in mine]
    if differ:
        raise ResumeError(_shape_message(checkpoint_root(output_dir) / tag, differ))


def _saved_shapes(states: Path) -> dict[str, tuple]:
    """Name -> shape of the head tensors a checkpoint holds. ZeRO-3 saves empty partitions as
    `module` tensors: the full shapes of its parameters are in `param_shapes`."""
    saved = torch.load(states, map_location="cpu", weights_only=False, mmap=True)
    shapes = {name: tuple(t.shape) for name, t in (saved.get("module") or {}).items()}
    for group in saved.get("param_shapes") or []:
        shapes.update((name, tuple(shape)) for name, shape in group.items())
    return {name.removeprefix("head."): shape for name, shape in shapes.items()}


def _shape_message(where: Path, differ: list[str]) -> str:
    return (f"checkpoint {where} holds a head of another shape than this recipe builds "
            f"({'; '.join(differ[:3])}{f'; {len(differ) - 3} more' if len(differ) > 3 else ''}): "
            "start over with --no-resume or choose another output.dir")


def latest_checkpoint(output_dir: str | Path) -> str | None:
    """The newest complete checkpoint's tag, or None."""
    tags = complete_tags(output_dir)
    return tags[-1][1] if tags else None


def rng_state() -> dict:
    import numpy as np

    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, output_dir: str | Path, step: int, trainer_state: dict, rank: int,
                    keep_last: int = 2) -> Path:
    """Collective: every rank calls it. Returns the checkpoint folder."""
    root = checkpoint_root(output_dir)
    tag = tag_for(step)
    folder = root / tag
    if rank == 0 and folder.exists():  # an unfinished save of this very step: start clean
        shutil.rmtree(folder)
    _barrier()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / f"rng-rank{rank}.pt")
    # frozen target copies (embeddings, LM head) are rebuilt from the target, never saved
    engine.save_checkpoint(str(root), tag=tag, client_state={"specdec": trainer_state},
                           exclude_frozen_parameters=True)
    _barrier()
    if rank == 0:
        _atomic_write(folder / "trainer_state.json", json.dumps(trainer_state, indent=2))
        _atomic_write(folder / COMPLETE, tag + "\n")
        _prune(root, keep_last, keep=tag)
    _barrier()
    return folder


def _prune(root: Path, keep_last: int, keep: str) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale partial ones."""
    tags = complete_tags(root.parent)
    doomed = [t for _, t in tags[:-keep_last]] if keep_last > 0 else []
    newest = tags[-1][0] if tags else -1
    for entry in root.iterdir():
        match = TAG_RE.match(entry.name)
        if match and not (entry / COMPLETE).exists() and int(match.group(1)) < newest:
            doomed.append(entry.name)  # a save that was killed half-way
    for tag in doomed:
        if tag != keep:
            shutil.rmtree(root / tag, ignore_errors=True)


def load_checkpoint(engine, output_dir: str | Path, tag: str, rank: int) -> dict:
    """Restore engine (weights, optimizer, scheduler) and this rank's RNG; returns trainer state."""
    root = checkpoint_root(output_dir)
    # not strict: the checkpoint lacks the frozen target copies on purpose
    try:
        path, client = engine.load_checkpoint(str(root), tag=tag, load_module_strict=False,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        # the recipe's head changed shape since this checkpoint (a head field, the target)
        mismatches = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        raise ResumeError(_shape_message(root / tag, mismatches)) from None
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    state = (client or {}).get("specdec")
    if state is None:
        state = json.loads((root / tag / "trainer_state.json").read_text())
    rng_file = root / tag / f"rng-rank{rank}.pt"
    if rng_file.exists():  # absent when resuming with more processes than were saved
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
