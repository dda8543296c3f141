"""The DeepSpeed training loop for any draft head.

The loop knows heads only through their protocol: ``head.loss(batch, **loss_kwargs)`` to
train, ``head.acceptance(batch, depth)`` to evaluate, ``head.save_pretrained(dir)`` at the
end. It never looks at the head's type. One optimizer step = ``grad_accum`` micro-batches
on each of ``world`` processes; which sequences those are is fixed by
``batches.GlobalBatchPlan`` from the step number alone, so data-parallel runs reproduce the
single-process loss curve and a resumed run reproduces the uninterrupted one.
"""
from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

from specdec.infer.dtypes import native_bf16

from .batches import GlobalBatchPlan, eval_batches
from .checkpoint import latest_checkpoint, load_checkpoint, require_checkpoint, save_checkpoint
from .config import Recipe, split_loss
from .evaluate import EvalResult, evaluate, format_table


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> DistInfo:
    """Join the launcher's process group, or make a one-process group for a plain run.

    ``deepspeed`` / ``torchrun`` set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT. A plain
    ``specdec-train`` has none, and DeepSpeed would then try MPI discovery (mpi4py): set
    them for a single process on a free port instead.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")
    cuda = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"  # read by DeepSpeed at its first accelerator query
    import deepspeed
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    else:
        # DeepSpeed's shared-memory all-reduce for CPUs is a C++ op compiled on first use (~1 min
        # on 2 cores, measured) that gloo replaces at no cost worth a build for draft heads'
        # small gradients. DeepSpeed keeps this dict and reads it when it sets up its backend.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        # generous timeout: rank 0 may regenerate data / capture features while others wait
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False,
                                   timeout=timedelta(hours=6))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(), device)


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def use_bf16(recipe: Recipe, device: torch.device) -> bool:
    precision = recipe.deepspeed.precision
    return precision == "bf16" or (precision == "auto" and native_bf16(device))


def schedule_steps(recipe: Recipe, steps_per_epoch: int) -> tuple[int, int]:
    """(total optimizer steps, warmup steps) from epochs / max_steps and warmup."""
    o = recipe.optim
    total = o.max_steps if o.max_steps is not None else o.epochs * steps_per_epoch
    warmup = o.warmup if isinstance(o.warmup, int) else int(round(o.warmup * total))
    return total, min(warmup, total)


REFIT_AT = (0.5, 0.75)  # shares of the run at which a time budget fits the step count again


def budget_fit(done: int, total: int, spent_s: float, step_s: float, budget_s: float) -> int:
    """Steps a run may take in all: as many as its time budget leaves room for at ``step_s``
    seconds a step after ``spent_s`` already spent, never fewer than ``done`` nor more than ``total``."""
    room = max(budget_s - spent_s, 0.0) / max(step_s, 1e-9)
    return max(done, min(total, done + int(room)))


def deepspeed_config(recipe: Recipe, world_size: int, bf16: bool, total: int, warmup: int) -> dict:
    """The DeepSpeed config dict; ``deepspeed.extra`` is deep-merged over it last."""
    o = recipe.optim
    cfg = {
        "train_micro_batch_size_per_gpu": o.micro_batch_size,
        "gradient_accumulation_steps": o.grad_accum,
        "train_batch_size": o.micro_batch_size * o.grad_accum * world_size,
        "gradient_clipping": float(o.clip),
        "zero_optimization": {"stage": recipe.deepspeed.zero_stage},
        # our torch.optim.AdamW: skips building DeepSpeed's cpu_adam / fused Adam extensions
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bool(bf16)},
        "scheduler": lr_scheduler_config(o.schedule, o.lr, total, warmup),
        "steps_per_print": 1 << 30,  # we print our own progress
        "wall_clock_breakdown": False,
    }
    return _deep_merge(cfg, recipe.deepspeed.extra)


def lr_scheduler_config(schedule: str, lr: float, total: int, warmup: int) -> dict:
    """WarmupCosineLR / WarmupDecayLR / WarmupLR with a linear warmup from 0 (none if 0 steps)."""
    steps = max(1, warmup)  # DeepSpeed wants a positive count; with warmup 0 the ramp is flat
    if schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total, steps), "warmup_num_steps": steps,
            "warmup_min_ratio": 0.0 if warmup else 1.0, "cos_min_ratio": 0.0,
            "warmup_type": "linear"}}
    params = {"warmup_min_lr": 0.0 if warmup else lr, "warmup_max_lr": lr,
              "warmup_num_steps": steps, "warmup_type": "linear"}
    if schedule == "linear":
        return {"type": "WarmupDecayLR", "params": {**params, "total_num_steps": max(total, steps)}}
    return {"type": "WarmupLR", "params": params}


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters; weight decay on matrices only (not norms, biases, scalars)."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and weight_decay > 0 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the head has no trainable parameters")
    groups = [{"params": decay, "weight_decay": weight_decay}] if decay else []
    return groups + ([{"params": no_decay, "weight_decay": 0.0}] if no_decay else [])


class _HeadLoss(nn.Module):
    """What DeepSpeed wraps: forward(batch) = head.loss(batch, **loss_kwargs)."""

    def __init__(self, head: nn.Module, loss_kwargs: dict):
        super().__init__()
        self.head = head
        self.loss_kwargs = dict(loss_kwargs)

    def forward(self, batch):
        return self.head.loss(batch, **self.loss_kwargs)


class Trainer:
    """Train ``head`` on ``train_source`` (a batches.StoreSource / OnlineSource)."""

    def __init__(self, recipe: Recipe, head: nn.Module, train_source, eval_source, dist: DistInfo):
        import deepspeed

        self.recipe, self.head, self.dist = recipe, head, dist
        self.train_source, self.eval_source = train_source, eval_source
        self.out = Path(recipe.output.dir)
        self.bf16 = use_bf16(recipe, dist.device)
        self.float_dtype = torch.bfloat16 if self.bf16 else torch.float32
        o = recipe.optim
        self.plan = GlobalBatchPlan(len(train_source), o.micro_batch_size, o.grad_accum,
                                    dist.world_size, dist.rank, o.seed, lengths=train_source.lengths())
        self.total_steps, self.warmup_steps = schedule_steps(recipe, self.plan.steps_per_epoch)
        self.planned_steps = self.total_steps  # the recipe's count, before any time budget
        # bf16 training casts the whole module, the parameters optim.freeze keeps included: their
        # exact starting values are saved instead, so a frozen LM head stays the target's rows
        saved = head.saved_state_dict() if self.bf16 else {}
        self.frozen_start = {n: p.detach().to("cpu", copy=True) for n, p in head.named_parameters()
                             if not p.requires_grad and n in saved}
        head.to(dist.device)
        _, self.loss_kwargs = split_loss(type(head), recipe.loss)
        module = _HeadLoss(head, self.loss_kwargs)
        optimizer = torch.optim.AdamW(param_groups(module, o.weight_decay), lr=o.lr,
                                      betas=tuple(o.betas), eps=o.eps)
        self.ds_config = deepspeed_config(recipe, dist.world_size, self.bf16,
                                          self.total_steps, self.warmup_steps)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, config=self.ds_config)
        # DeepSpeed's schedulers stand at iteration -1 (lr 0 or 1) until the first step;
        # start at 1 so optimizer step s (1-based) uses the schedule's lr at s
        self.scheduler.step(1)
        # train_seconds: time spent in the loop over every process start (optim.max_minutes);
        # total_steps is added once a time budget has fixed the step count
        self.state = {"step": 0, "tokens": 0, "train_seconds": 0.0}
        self.logger = None
        self.clock = time.perf_counter  # a test drives the time budget with its own clock

    # ------------------------------------------------------------------ resume
    def restore(self, resume: bool | None) -> bool:
        """Load the newest complete checkpoint (resume None = if one exists). True if loaded."""
        if resume:
            require_checkpoint(self.out)
        tag = latest_checkpoint(self.out)
        if resume is False or tag is None:
            return False
        self.state = {"train_seconds": 0.0, **load_checkpoint(self.engine, self.out, tag, self.dist.rank)}
        if "total_steps" in self.state:  # a time budget fixed it before the checkpoint: keep it
            self._set_total_steps(self.state["total_steps"])
        self._say(f"resumed from {self.out / 'checkpoints' / tag} at step {self.state['step']}")
        if self.state["step"] > self.total_steps:  # a smaller max_steps does not undo steps taken
            self._say(f"that is past this recipe's {self.total_steps} steps: nothing to train; final/ "
                      f"holds the step-{self.state['step']} head (--no-resume trains {self.total_steps})")
        return True

    # ------------------------------------------------------------------ training
    def train(self, logger) -> dict:
        """Run until total_steps (checkpointing / evaluating on the way); returns the state."""
        from tqdm.auto import tqdm

        self.logger = logger
        r = self.recipe
        self.engine.train()
        bar = tqdm(total=self.total_steps, initial=self.state["step"], desc="train", unit="step",
                   disable=not self.dist.is_main, dynamic_ncols=True, file=sys.stderr)
        step_times: list[float] = []  # this process's steps but its first (warm-up), for the budget
        fit_from = 0  # step_times[fit_from:] were timed since this process's last fit
        first = True
        while self.state["step"] < self.total_steps:
            started = self.clock()
            lr = self.scheduler.get_last_lr()[0]  # the lr this step uses
            sums, tokens = self._one_step(self.state["step"])
            self.state["step"] += 1
            step = self.state["step"]
            means, tokens = self._reduce(sums, tokens)
            if not math.isfinite(means["loss"]):  # reduced: every process stops together
                raise FloatingPointError(f"step {step}: loss is {means['loss']} (lower optim.lr?)")
            self.state["tokens"] += tokens
            elapsed = max(self.clock() - started, 1e-9)
            self.state["train_seconds"] += elapsed
            if not first:
                step_times.append(elapsed)
            first = False
            if self._budget_due(len(step_times) - fit_from):
                self._fit_to_budget(step_times[fit_from:])
                fit_from = len(step_times)
                bar.total = self.total_steps
            record = {"step": step, **means, "lr": lr,
                      "tokens": self.state["tokens"], "tokens_per_s": tokens / elapsed,
                      "epoch": (step - 1) // self.plan.steps_per_epoch}
            if step % r.output.log_every == 0 or step == self.total_steps:
                logger.log_train(record)
            bar.set_postfix(loss=f"{means['loss']:.4f}", tok_s=f"{tokens / elapsed:,.0f}", refresh=False)
            bar.update(1)
            last = step == self.total_steps
            if r.output.eval_every and step % r.output.eval_every == 0 and not last:
                started = self.clock()
                self.evaluate(step)
                self.state["train_seconds"] += self.clock() - started
            if (r.output.save_every and step % r.output.save_every == 0) or last:
                self.save(step)
        bar.close()
        return self.state

    # ------------------------------------------------------------------ time budget
    def _budget_due(self, timed: int) -> bool:
        """A time budget fixes the step count after enough timed steps that their mean means
        something (5% of the planned steps, at least 20; at least 3 timed in this process), early
        enough that moving the LR schedule's end changes little; then fits it again at REFIT_AT of
        the run, from the steps timed since, as a machine's speed drifts (the EAGLE-3 recipe's
        first 50 steps took 0.99 s, the run 1.13 s a step on average: 18.4 of its 16 minutes).
        ``timed``: this process's steps timed since its last fit (all of them before the first)."""
        step = self.state["step"]
        if self.recipe.optim.max_minutes is None or step >= self.total_steps or timed < 3:
            return False
        if "total_steps" not in self.state:
            return step >= max(20, self.total_steps // 20)
        fits = self.state.get("budget_fits", 1)
        return fits <= len(REFIT_AT) and step >= REFIT_AT[fits - 1] * self.total_steps

    def _fit_to_budget(self, step_times: list[float]) -> None:
        import torch.distributed as dist

        # every process must stop at the same step: fit to the slowest one's figures
        figures = torch.tensor([sum(step_times) / len(step_times), self.state["train_seconds"]],
                               dtype=torch.float64)
        if self.dist.world_size > 1:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        step_s, spent_s = figures.tolist()
        budget = self.recipe.optim.max_minutes
        first = "total_steps" not in self.state
        before = self.total_steps
        planned = self.planned_steps  # a re-fit may give steps back, up to the recipe's count
        self._set_total_steps(budget_fit(self.state["step"], planned, spent_s, step_s, budget * 60))
        self.state["total_steps"] = self.total_steps
        self.state["budget_fits"] = self.state.get("budget_fits", 0) + 1
        if first or self.total_steps != before:
            self._say(f"time budget {budget:g} min (optim.max_minutes): {self.total_steps} of {planned} "
                      f"steps fit at {step_s:.2f} s a step{'' if first else ' (re-fit)'}; the LR "
                      "schedule ends there")

    def _set_total_steps(self, total: int) -> None:
        self.total_steps = int(total)
        if hasattr(self.scheduler, "total_num_steps"):  # cosine / linear decay: end at the new total
            self.scheduler.total_num_steps = max(self.total_steps, self.warmup_steps, 1)

    def _one_step(self, step: int) -> tuple[dict, int]:
        sums: dict[str, float] = {}
        tokens = 0
        for a in range(self.recipe.optim.grad_accum):
            positions = self.plan.micro_batch(step, a)
            batch = self.train_source.batch(positions, self.float_dtype, self.dist.device)
            loss, metrics = self.engine(batch)
            self.engine.backward(loss)
            self.engine.step()
            for k, v in {"loss": loss.detach(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v) / self.recipe.optim.grad_accum
            tokens += int(batch["attention_mask"].sum())
        return sums, tokens

    def _reduce(self, sums: dict, tokens: int) -> tuple[dict, int]:
        """Mean of the step's metrics over processes, total tokens over processes."""
        import torch.distributed as dist

        names = sorted(sums)
        packed = torch.tensor([sums[k] for k in names] + [float(tokens)], dtype=torch.float64)
        if self.dist.world_size > 1:
            dist.all_reduce(packed)
            packed[:-1] /= self.dist.world_size
        return dict(zip(names, packed[:-1].tolist())), int(packed[-1])

    # ------------------------------------------------------------------ checkpoints / eval
    def save(self, step: int) -> None:
        save_checkpoint(self.engine, self.out, step, dict(self.state), self.dist.rank,
                        keep_last=self.recipe.output.keep_last)

    def evaluate(self, step: int | None = None) -> EvalResult | None:
        """Acceptance / tau / calibration on this process's share of the eval set, reduced."""
        if self.eval_source is None or len(self.eval_source) == 0:
            self._say("no eval sequences (data.eval_fraction = 0): skipping eval")
            return None
        depth = self.recipe.output.eval_depth
        shards = eval_batches(len(self.eval_source), self.recipe.optim.micro_batch_size,
                              self.dist.world_size, self.dist.rank)
        batches = (self.eval_source.batch(p, self.float_dtype, self.dist.device) for p in shards)
        result = evaluate(self.head, batches, depth, gather=self._gather,
                          loss_kwargs=self.loss_kwargs)
        step = self.state["step"] if step is None else step
        if self.logger is not None:
            self.logger.log_eval(step, result)
        self._say(format_table(result))
        return result

    def _gather(self, obj) -> list:
        import torch.distributed as dist

        if self.dist.world_size == 1:
            return [obj]
        out = [None] * self.dist.world_size
        dist.all_gather_object(out, obj)
        return out

    def save_final(self, result: EvalResult | None) -> Path:
        """``<output.dir>/final/``: the head (save_pretrained), eval.json, the resolved recipe."""
        final = self.out / "final"
        params = list(self.head.parameters())
        if self.recipe.deepspeed.zero_stage == 3:  # parameters are partitioned: gather them
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                self._write_final(final, result)
        else:
            self._write_final(final, result)
        barrier()
        return final

    def _write_final(self, final: Path, result: EvalResult | None) -> None:
        if not self.dist.is_main:
            return
        self.head.save_pretrained(final, overrides=self.frozen_start)
        resolved = self.out / "recipe.resolved.yaml"
        if resolved.exists():
            (final / "recipe.yaml").write_text(resolved.read_text())
        for where in (self.out / "eval.json", final / "eval.json"):
            if result is None:  # no eval set: never leave an older run's report behind
                where.unlink(missing_ok=True)
            else:
                where.write_text(json.dumps({"step": self.state["step"], **result.to_dict()}, indent=2) + "\n")
        self._say(f"saved the trained head to {final}")

    def _say(self, text: str) -> None:
        if self.dist.is_main:
            print(text, file=sys.stderr, flush=True)
