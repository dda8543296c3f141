"""The DeepSpeed trainer: every head learns on a tiny recipe; resume after kill -9 is exact;
2 data-parallel processes reproduce the 1-process loss curve."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.heads import head_types, load_head
from specdec.train.batches import GlobalBatchPlan
from specdec.train.evaluate import calibration_sums, calibration_table, expected_accepted_length

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny"
DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def metrics(out: Path, kind: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def train_losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out, "train")]


def eval_taus(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval/tau"]) for r in metrics(out, "eval")]


# ----------------------------------------------------------------------------- pure logic

def test_batch_plan_is_independent_of_world_size():
    """1 process x 2 accumulation steps and 2 processes x 1 step read the same micro-batches."""
    lengths = [int(x) for x in torch.randint(5, 50, (37,))]
    one = GlobalBatchPlan(37, 3, 2, world_size=1, rank=0, seed=1, lengths=lengths)
    two = [GlobalBatchPlan(37, 3, 1, world_size=2, rank=r, seed=1, lengths=lengths) for r in range(2)]
    assert one.steps_per_epoch == two[0].steps_per_epoch == 37 // 6
    for step in range(3 * one.steps_per_epoch):  # several epochs
        assert one.micro_batch(step, 0) == two[0].micro_batch(step, 0)
        assert one.micro_batch(step, 1) == two[1].micro_batch(step, 0)
    epoch = [i for s in range(one.steps_per_epoch) for a in range(2) for i in one.micro_batch(s, a)]
    assert len(set(epoch)) == len(epoch) == 36  # each sequence at most once per epoch


def test_budget_fit_takes_the_steps_that_fit_in_the_time_left():
    from specdec.train.trainer import budget_fit

    assert budget_fit(20, 1000, 20.0, 1.0, 120.0) == 120          # 100 s left at 1 s a step
    assert budget_fit(20, 1000, 20.0, 1.0, 3600.0) == 1000        # never more than planned
    assert budget_fit(20, 1000, 90.0, 1.0, 60.0) == 20            # over budget: stop where it is
    assert budget_fit(20, 1000, 20.0, 0.3, 29.0) == 50            # partial steps do not count


def test_tau_and_calibration():
    # conditional acceptances 0.8, 0.5: tau = 1 + 0.8 + 0.4
    assert expected_accepted_length([0.8, 0.5]) == pytest.approx(2.2)
    sums = calibration_sums([0.05, 0.05, 0.95, 0.95], [0, 1, 1, 1], bins=10)
    rows, ece = calibration_table(sums)
    assert [r["n"] for r in rows] == [2, 2]
    assert ece == pytest.approx(0.5 * abs(0.05 - 0.5) + 0.5 * abs(0.95 - 1.0))


def test_wandb_mode_is_offline_unless_logged_in(monkeypatch, tmp_path):
    from specdec.train.runlog import wandb_mode

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no credentials file
    assert wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password KEY\n")
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
    assert wandb_mode("offline") == "offline"  # the recipe's explicit choice wins


# ----------------------------------------------------------------------------- in-process runs

@pytest.mark.parametrize("head_type", sorted(head_types()))
def test_tiny_recipe_loss_goes_down(head_type, tmp_path, tiny_target):
    recipe_file = TINY / f"{head_type}.yaml"
    if not recipe_file.exists():
        pytest.skip(f"no tiny recipe for {head_type}")
    from specdec.infer.target import load_target
    from specdec.train.config import load_recipe
    from specdec.train.pipeline import run

    out = tmp_path / "run"
    recipe = load_recipe(recipe_file, [f"output.dir={out}", "wandb.mode=disabled", "optim.max_steps=10",
                                       "output.save_every=0", "data.limit=40"])
    final = run(recipe, resume=False)
    losses = train_losses(out)
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 * 0.98, losses
    report = json.loads((final / "eval.json").read_text())
    assert len(report["acceptance"]) == recipe.output.eval_depth and report["tau"] >= 1.0
    assert (out / "recipe.resolved.yaml").exists() and (final / "recipe.yaml").exists()
    head = load_head(final, load_target("tiny-llama"))  # the saved head rebuilds on its target
    assert type(head).head_type() == head_type
    if head_type != "eagle3":  # the others keep the data's token counts for drafting (DraftLogits)
        assert head.token_counts is not None and int(head.token_counts.sum()) > 0


def test_online_features_train_like_captured_ones(tmp_path, tiny_target):
    """mode: online (target in the loop) sees the same features as an offline capture."""
    from specdec.train.config import load_recipe
    from specdec.train.pipeline import run

    curves = {}
    for mode in ("offline", "online"):
        out = tmp_path / mode
        recipe = load_recipe(TINY / "eagle3.yaml", [f"output.dir={out}", f"data.mode={mode}", "data.limit=24",
                                                    "optim.max_steps=4", "output.save_every=0",
                                                    "wandb.mode=disabled"])
        run(recipe, resume=False)
        curves[mode] = train_losses(out)
    assert not (tmp_path / "online" / "features").exists()
    assert curves["online"] == pytest.approx(curves["offline"], rel=1e-4)


def test_frozen_parameters_keep_their_starting_values(tmp_path, tiny_target):
    """optim.freeze: the EAGLE-3 draft LM head starts as the target's rows and stays them, while
    the rest trains; a name that matches nothing fails before any work, naming it."""
    from specdec.infer.target import load_target
    from specdec.train.config import load_recipe
    from specdec.train.pipeline import run

    target = load_target("tiny-llama")
    heads = {}
    for freeze in ("[lm_head]", "[]"):
        out = tmp_path / f"freeze{len(freeze)}"
        recipe = load_recipe(TINY / "eagle3.yaml", [f"output.dir={out}", f"optim.freeze={freeze}", "data.limit=24",
                                                    "optim.max_steps=3", "output.save_every=0", "wandb.mode=disabled"])
        heads[freeze] = load_head(run(recipe, resume=False), target)
    for freeze, head in heads.items():
        rows = head.verifier_lm_head.weight[head.token_map]    # where set_draft_vocab starts it
        assert torch.equal(head.lm_head.weight, rows) == (freeze == "[lm_head]")
    # the rest still trains: fc started as [0 | I] (init_layer: -1) and moved
    fc, H = heads["[lm_head]"].fc.weight, heads["[lm_head]"].config.hidden_size
    assert not torch.equal(fc[:, -H:], torch.eye(H)) and fc[:, :-H].abs().sum() > 0

    bad = load_recipe(TINY / "eagle3.yaml", [f"output.dir={tmp_path / 'bad'}", "optim.freeze=[layers.0.mlpp]",
                                             "wandb.mode=disabled"])
    with pytest.raises(ValueError, match=r"optim\.freeze: 'layers\.0\.mlpp' names no trainable"):
        run(bad, resume=False)
    assert not (tmp_path / "bad" / "features").exists()  # failed before capturing anything
    from specdec.train.cli import main
    assert main([str(TINY / "eagle3.yaml"), f"output.dir={tmp_path / 'bad'}", "optim.freeze=[layers.0.mlpp]",
                 "wandb.mode=disabled"]) == 2                     # the command says so, no traceback


def test_explicit_resume_without_checkpoint_fails(tmp_path, capsys):
    from specdec.train.cli import main

    assert main([str(TINY / "eagle3.yaml"), f"output.dir={tmp_path}", "data.limit=24", "optim.max_steps=2",
                 "wandb.mode=disabled", "--resume"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "features").exists()  # said before any data work


def test_head_fields_the_target_rules_out_fail_before_any_work(tmp_path, capsys):
    from specdec.train.cli import main

    base = [str(TINY / "eagle3.yaml"), f"output.dir={tmp_path}", "wandb.mode=disabled"]
    assert main([*base, "head.aux_layers=[1, 2, 9]"]) == 2          # tiny-llama has 4 layers
    assert "aux layer ids [9] out of range" in capsys.readouterr().err
    assert main([*base, "head.draft_vocab_size=100000"]) == 2
    assert "draft_vocab_size=100000" in capsys.readouterr().err
    assert not (tmp_path / "features").exists()


def test_a_second_run_into_a_busy_output_dir_is_refused(tmp_path, capsys):
    from specdec.train.checkpoint import lock_output_dir
    from specdec.train.cli import main

    held = lock_output_dir(tmp_path)              # as a live run holds it (another process: flock)
    try:
        assert main([str(TINY / "eagle3.yaml"), f"output.dir={tmp_path}", "wandb.mode=disabled"]) == 2
        assert "in use by another specdec-train run (pid" in capsys.readouterr().err
    finally:
        held.close()
    assert main([str(TINY / "eagle3.yaml"), f"output.dir={tmp_path}", "data.limit=24", "optim.max_steps=1",
                 "wandb.mode=disabled"]) == 0


def test_resume_into_a_head_of_another_shape_says_so(tmp_path, capsys):
    from specdec.train.cli import main

    base = [str(TINY / "eagle3.yaml"), f"output.dir={tmp_path}", "data.limit=24", "optim.max_steps=2",
            "output.save_every=1", "wandb.mode=disabled"]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "optim.max_steps=1"]) == 0                  # fewer steps than were taken
    assert "past this recipe's 1 steps: nothing to train" in capsys.readouterr().err
    assert main([*base, "optim.max_steps=3", "head.draft_vocab_size=128"]) == 2
    err = capsys.readouterr().err
    assert "another shape" in err and "--no-resume" in err
    assert "d2t: checkpoint (256,), recipe (128,)" in err             # said before any data work
    assert (tmp_path / "final" / "model.safetensors").exists()       # the finished head is kept


def test_resume_into_another_head_type_or_more_heads_says_so(tmp_path, capsys):
    """Tensors only one side has (num_heads grown, another head type, under ZeRO-3 too) are
    named before any data work, not left to the optimizer's bare size mismatch."""
    from specdec.train.cli import main

    base = [f"output.dir={tmp_path}", "data.limit=24", "optim.max_steps=1", "wandb.mode=disabled",
            "deepspeed.zero_stage=3"]
    assert main([str(TINY / "medusa.yaml"), *base]) == 0
    capsys.readouterr()
    assert main([str(TINY / "medusa.yaml"), *base, "optim.max_steps=2", "head.num_heads=4"]) == 2
    assert "medusa_head.3.0.linear.weight: not in the checkpoint" in capsys.readouterr().err
    assert "num_heads: 3" in (tmp_path / "recipe.resolved.yaml").read_text()  # the checkpoint's record
    assert main([str(TINY / "hydra.yaml"), *base, "optim.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "another shape" in err and "not in the checkpoint" in err and "more)" in err


# ----------------------------------------------------------------------------- subprocess runs

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}  # no in-process group leaks
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return env


RUN_ARGS = ["optim.max_steps=6", "optim.micro_batch_size=2", "output.save_every=2", "data.limit=32",
            "output.eval_depth=2", "output.eval_every=3"]
KILL_DRIVER = """
import os, signal, sys
from specdec.train import trainer
real_step = trainer.Trainer._one_step
def one_step(self, step):
    if step == 3:  # after the checkpoint at step 2 and one more logged step: die like kill -9
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(self, step)
trainer.Trainer._one_step = one_step
from specdec.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


BUDGET_DRIVER = """
import itertools, os, signal, sys
from specdec.train import trainer
ticks = itertools.count()
slow_from = int(os.environ.get("SLOW_FROM_STEP", 1 << 30))
now = [0.0]
def clock():  # read twice a step: a step takes 0.5 s, or 1 s from step SLOW_FROM_STEP (0-based) on
    i = next(ticks)
    now[0] += 0.5 if i < 2 * slow_from else 1.0
    return now[0]
real_init, real_step = trainer.Trainer.__init__, trainer.Trainer._one_step
def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    self.clock = clock
def one_step(self, step):
    if step == int(os.environ.get("KILL_AT_STEP", -1)):
        os.kill(os.getpid(), signal.SIGKILL)
    return real_step(self, step)
trainer.Trainer.__init__, trainer.Trainer._one_step = init, one_step
from specdec.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _train(out: Path, *extra: str, launcher=(sys.executable, "-m", "specdec.train.cli"), check=True):
    cmd = [*launcher, str(TINY / "eagle3.yaml"), f"output.dir={out}", *RUN_ARGS, *extra]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """Uninterrupted 1-process run: global batch 4 = 2 sequences x 2 accumulation steps."""
    out = tmp_path_factory.mktemp("reference") / "run"
    _train(out, "optim.grad_accum=2")
    return out


def _final_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


@pytest.mark.slow
def test_resume_after_kill_reproduces_the_uninterrupted_run(reference_run, tmp_path):
    out = tmp_path / "run"
    driver = tmp_path / "kill_driver.py"
    driver.write_text(KILL_DRIVER)
    killed = _train(out, "optim.grad_accum=2", launcher=(sys.executable, str(driver)), check=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (out / "final").exists()
    assert len(train_losses(out)) == 3  # step 3 ran after the last checkpoint and is redone
    resumed = _train(out, "optim.grad_accum=2")
    assert "resumed from" in resumed.stderr and "step-00000002" in resumed.stderr
    assert train_losses(out) == pytest.approx(train_losses(reference_run), rel=1e-6, abs=1e-7)
    assert eval_taus(out) == eval_taus(reference_run) and [s for s, _ in eval_taus(out)] == [3, 6]
    ref, got = _final_weights(reference_run), _final_weights(out)
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-6, atol=1e-7, msg=name)
    # checkpoints: the newest keep_last (2) complete ones survive; wandb logged offline
    tags = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert tags == ["step-00000004", "step-00000006"]
    assert any((out / "wandb").glob("offline-run-*"))


@pytest.mark.slow
def test_a_time_budget_fixes_the_step_count_and_a_resumed_run_keeps_it(tmp_path, monkeypatch):
    """optim.max_minutes=0.25 (15 s) at 0.5 s a step: the fit at step 20 (10 s spent) leaves room
    for 10 more steps of the planned 60, and the cosine schedule ends at 30, not 60."""
    driver = tmp_path / "budget_driver.py"
    driver.write_text(BUDGET_DRIVER)
    budget = ["optim.max_steps=60", "optim.max_minutes=0.25", "output.eval_every=0"]
    launcher = (sys.executable, str(driver))
    whole = _train(tmp_path / "whole", *budget, launcher=launcher)
    assert "30 of 60 steps fit" in whole.stderr
    assert re.search(r"specdec-train: finished in [0-9.]+ min \(target \+ data [0-9.]+, features [0-9.]+, "
                     r"training [0-9.]+, eval \+ save [0-9.]+\)", whole.stderr)
    rows = metrics(tmp_path / "whole", "train")
    assert [r["step"] for r in rows][-1] == 30
    peak = max(r["lr"] for r in rows)
    assert rows[-1]["lr"] < 0.02 * peak  # the schedule's end moved to step 30 (at 60 it would be ~0.5)
    state = json.loads((tmp_path / "whole" / "checkpoints" / "step-00000030" / "trainer_state.json").read_text())
    assert state["total_steps"] == 30

    out = tmp_path / "killed"
    monkeypatch.setenv("KILL_AT_STEP", "25")  # after the fit and the checkpoint at step 24
    killed = _train(out, *budget, launcher=launcher, check=False)
    monkeypatch.delenv("KILL_AT_STEP")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _train(out, *budget, launcher=launcher)
    assert "step-00000024" in resumed.stderr and "steps fit" not in resumed.stderr
    assert train_losses(out) == pytest.approx(train_losses(tmp_path / "whole"), rel=1e-6, abs=1e-7)


def test_a_time_budget_fits_again_when_steps_slow_down(tmp_path, monkeypatch):
    """The fit at step 20 (0.5 s a step: 30 of 60 steps in 15 s); from step 21 on a step takes 1 s,
    so the re-fit at half the run, from the 3 steps timed since, leaves room for 25 steps in all,
    and the run ends within its budget."""
    driver = tmp_path / "budget_driver.py"
    driver.write_text(BUDGET_DRIVER)
    monkeypatch.setenv("SLOW_FROM_STEP", "20")
    out = tmp_path / "slow"
    run = _train(out, "optim.max_steps=60", "optim.max_minutes=0.25", "output.eval_every=0",
                 launcher=(sys.executable, str(driver)))
    assert "30 of 60 steps fit at 0.50 s" in run.stderr
    assert "25 of 60 steps fit at 1.00 s a step (re-fit)" in run.stderr
    rows = metrics(out, "train")
    assert [r["step"] for r in rows][-1] == 25
    assert rows[-1]["lr"] < 0.02 * max(r["lr"] for r in rows)  # the schedule's end moved again
    state = json.loads((out / "checkpoints" / "step-00000025" / "trainer_state.json").read_text())
    assert state["total_steps"] == 25 and state["train_seconds"] <= 15.0


@pytest.mark.slow
def test_two_processes_match_one(reference_run, tmp_path):
    """2 data-parallel processes x 1 micro-batch = the same global batch as the reference."""
    out = tmp_path / "run"
    from specdec.train.trainer import _free_port

    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(_free_port()), "-m", "specdec.train.cli")
    _train(out, "optim.grad_accum=1", "wandb.mode=disabled", launcher=launcher)
    assert train_losses(out) == pytest.approx(train_losses(reference_run), rel=1e-4)
    assert [s for s, _ in eval_taus(out)] == [3, 6]
    eval_1 = json.loads((reference_run / "eval.json").read_text())
    eval_2 = json.loads((out / "eval.json").read_text())
    assert eval_2["count"] == eval_1["count"]  # the eval shards add up to the whole eval set
    assert eval_2["tau"] == pytest.approx(eval_1["tau"], abs=1e-3)
    ref, got = _final_weights(reference_run), _final_weights(out)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-3, atol=1e-4, msg=name)
    # the finished run again in 1 process: its features are captured anew and the 2 shares go
    proc = _train(out, "optim.grad_accum=2", "wandb.mode=disabled")
    assert "nothing to train" not in proc.stderr and "removing" in proc.stderr
    assert sorted(p.name for p in (out / "features" / "train").iterdir()) == ["part-0-of-1"]


def test_ctrl_c_says_how_to_resume_in_one_line(tmp_path, capsys, monkeypatch):
    from specdec.train import pipeline
    from specdec.train.checkpoint import tag_for
    from specdec.train.cli import main

    def interrupted(recipe, resume=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "run", interrupted)
    argv = [str(TINY / "medusa.yaml"), f"output.dir={tmp_path}"]
    assert main(argv) == 130
    assert "interrupted; no checkpoint was saved yet" in capsys.readouterr().err
    (tmp_path / "checkpoints" / tag_for(20)).mkdir(parents=True)
    (tmp_path / "checkpoints" / tag_for(20) / "COMPLETE").write_text("")
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"resumes from {tmp_path / 'checkpoints' / tag_for(20)}" in err


def test_fewer_sequences_than_a_batch_say_so_before_the_capture(tmp_path, capsys):
    from specdec.train.cli import main

    assert main([str(TINY / "medusa.yaml"), f"output.dir={tmp_path}", "data.limit=4",
                 "wandb.mode=disabled"]) == 2
    assert "3 training sequences are fewer than one global batch" in capsys.readouterr().err
    assert not (tmp_path / "features").exists()
