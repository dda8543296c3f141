"""The speculation controller: cost model fit, goodput decisions, hysteresis, bandit."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from specdec.heads.tree import TreeBudget
from specdec.infer.server.controller import (
    DIP_STEPS, REPLAN_STEPS, SPEC_START_LEAD, GoodputPolicy, StepObservation, ThompsonPolicy, best_plan, budget_grid,
    make_controller)
from specdec.infer.server.costmodel import AcceptanceTracker, CostModel, CostPrior


def feed_cost(ctl_or_model, truth, rng, steps=200, batches=(1, 2, 4, 8, 16), max_extra=32):
    """Observe noisy synthetic step timings t = truth(B, N) drawn over a spread of shapes."""
    model = getattr(ctl_or_model, "cost", ctl_or_model)
    for _ in range(steps):
        b = rng.choice(batches)
        n = b * (1 + rng.choice([0, 2, 4, 8, 16, max_extra]))
        model.observe(b, n, truth(b, n) * (1 + 0.02 * rng.uniform(-1, 1)))


def test_budget_grid_levels():
    grid = budget_grid((8, 2, 0, 32), max_depth=6, topk=4)
    assert grid == [TreeBudget(0, 0, 1), TreeBudget(2, 2, 1), TreeBudget(8, 6, 2), TreeBudget(32, 6, 4)]
    assert budget_grid((4,))[0].max_nodes == 0  # plain is always on the menu
    with pytest.raises(ValueError, match=">= 0"):
        budget_grid((-1, 4))


def test_the_servers_top_level_is_the_drafters_own_tree():
    from specdec.infer.server.cli import server_grid

    top = TreeBudget(4, 4, 3)  # EAGLE-3's CPU tree: budget_grid alone would make it a 4-token chain
    assert budget_grid((0, 2, 4), max_depth=4, topk=3)[-1] == TreeBudget(4, 4, 1)
    assert server_grid(top) == [TreeBudget(0, 0, 1), TreeBudget(2, 2, 1), top]
    assert server_grid(TreeBudget(12, 12, 4), (0, 8, 12))[1:] == [TreeBudget(8, 8, 1), TreeBudget(12, 12, 4)]
    assert server_grid(top, spec_topk=1)[-1] == TreeBudget(4, 4, 1)  # asked for: the user's shape


def test_cost_model_recovers_linear_costs_and_round_trips(tmp_path):
    truth = lambda b, n: 0.010 + 0.001 * b + 0.0004 * n  # noqa: E731
    model = CostModel(prior=CostPrior(a=0.05, b=0.0, c=0.0))  # a deliberately wrong prior
    feed_cost(model, truth, random.Random(0))
    for b, n in [(1, 1), (4, 40), (16, 300)]:
        assert model.predict(b, n) == pytest.approx(truth(b, n), rel=0.05)
    # the controller's scalar calls take a plain-float path: it must agree with the array one
    many = model.predict(np.array([1, 4, 16]), np.array([1, 40, 300]), np.array([0, 64, 0]), np.array([0, 1, 2]))
    assert [model.predict(1, 1, 0, 0), model.predict(4, 40, 64, 1), model.predict(16, 300, 0, 2)] == \
        pytest.approx(many.tolist(), rel=1e-9)
    path = tmp_path / "cost.json"
    model.save(path)
    again = CostModel.load(path)
    assert again.predict(8, 100) == pytest.approx(model.predict(8, 100), rel=1e-3)
    assert json.loads(path.read_text())["format"] == "specdec-cost-model/2"
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a specdec cost profile"):
        CostModel.load(bad)


def test_cost_model_separates_prefill_time():
    truth = lambda b, n, p: 0.010 + 0.0004 * n + 0.0002 * p  # noqa: E731
    model = CostModel()
    rng = random.Random(0)
    for _ in range(300):
        b = rng.choice((1, 2, 4, 8))
        n, p = b * (1 + rng.choice([0, 4, 8])), rng.choice([0, 0, 128, 512])
        model.observe(b, n, truth(b, n, p), prefill=p)
    assert model.predict(4, 36) == pytest.approx(truth(4, 36, 0), rel=0.05)  # decode-only prediction
    assert model.coefficients()["e"] == pytest.approx(0.0002, rel=0.1)


def test_cost_model_uses_prior_before_any_observation():
    model = CostModel(prior=CostPrior(a=0.02, b=0.001, c=0.0005))
    assert model.predict(2, 10) == pytest.approx(0.02 + 0.002 + 0.005)
    assert model.predict(1, 100) > model.predict(1, 1)  # more tokens never cost less


def test_acceptance_tracker_censors_unseen_positions():
    tr = AcceptanceTracker(max_depth=4, num_levels=2, prior=0.5, shrink=1e-6)
    for _ in range(50):  # always 1 of 4 accepted: position 1 hit, position 2 missed, 3-4 untested
        tr.observe("r", 1, drafted=4, accepted=1)
    rates = tr.level_rates()[1]
    assert rates[0] == pytest.approx(1.0, abs=1e-3) and rates[1] == pytest.approx(0.0, abs=1e-3)
    exp = tr.expected_tokens(["r"], [0, 4])
    assert exp[0, 0] == 1.0 and exp[0, 1] == pytest.approx(2.0, abs=1e-2)


def _controller_with(truth, alpha, policy="goodput", **kw):
    ctl = make_controller(policy, grid=budget_grid((0, 2, 4, 8)), **kw)
    feed_cost(ctl, truth, random.Random(1), max_extra=8)
    # 3 requests: batch 2-3 takes the models' first call (a fresh batch of 4 or more starts plain)
    rids = [f"r{i}" for i in range(3)]
    for _ in range(40):  # every request accepts each position with probability alpha (expected)
        for r in rids:
            for lvl in range(1, 4):
                depth = ctl.depths[lvl]
                acc = 0
                while acc < depth and random.random() < alpha:
                    acc += 1
                ctl.acceptance.observe(r, lvl, depth, acc)
    return ctl, rids


def plan_after(ctl, rids, steps=4):
    plan = {}
    # Several steps so hysteresis (patience 3) lets the decision through; unmeasured, the gate
    # plays the models' call until its first exploration run (the 5th decision).
    for _ in range(steps):
        plan = ctl.plan(rids)
    return plan


def test_goodput_picks_plain_when_speculation_loses():
    random.seed(0)
    # Every verified token costs as much as a whole step's overhead: drafting can't pay.
    truth = lambda b, n: 0.001 + 0.010 * n  # noqa: E731
    ctl, rids = _controller_with(truth, alpha=0.5)
    plan = plan_after(ctl, rids)
    assert all(b.max_nodes == 0 for b in plan.values())


def test_goodput_speculates_when_verification_is_nearly_free():
    random.seed(0)
    truth = lambda b, n: 0.030 + 0.0005 * b + 0.0001 * n  # memory-bound: extra tokens are cheap  # noqa: E731
    ctl, rids = _controller_with(truth, alpha=0.8)
    plan = plan_after(ctl, rids)
    assert all(b.max_nodes > 0 for b in plan.values())
    # and the chosen plan is predicted to beat plain decoding by a wide margin
    levels = [ctl.grid.index(plan[r]) for r in rids]
    assert ctl.predicted_goodput(rids, levels) > 1.5 * ctl.predicted_goodput(rids, [0] * len(rids))


def test_goodput_gives_budget_to_the_request_that_accepts():
    # Moderately expensive tokens: only a request whose drafts are accepted is worth drafting for.
    cost = lambda n, groups: 0.02 + 0.002 * n  # noqa: E731
    exp = np.array([[1.0, 1.1, 1.15, 1.2],  # drafts for r0 almost never accepted
                    [1.0, 2.9, 4.6, 6.5]])  # r1 accepts nearly everything
    levels = best_plan(exp, [0, 2, 4, 8], cost)
    assert levels[0] == 0 and levels[1] > 0


def test_best_plan_matches_brute_force():
    rng = np.random.default_rng(0)
    nodes = [0, 2, 4, 8]
    for _ in range(20):
        alpha = rng.uniform(0.2, 0.95, size=(3, 1))
        depths = np.array([0, 2, 4, 6])
        exp = 1 + np.array([[sum(a ** k for k in range(1, d + 1)) for d in depths] for a in alpha[:, 0]])
        cost = lambda n, groups, c=rng.uniform(1e-4, 5e-3): 0.02 + c * n  # noqa: E731
        greedy = best_plan(exp, nodes, cost)
        g = lambda lv: sum(exp[i, l] for i, l in enumerate(lv)) / cost(sum(1 + nodes[l] for l in lv), 0)  # noqa: E731
        brute = max(g((a, b, c)) for a in range(4) for b in range(4) for c in range(4))
        assert g(greedy) == pytest.approx(brute, rel=1e-9)


def test_costly_drafter_calls_favour_one_shared_budget():
    # Two requests with different acceptance would each get their own depth if drafter calls
    # were free; at 30 ms per extra drafter call they share one budget.
    exp = np.array([[1.0, 1.8, 2.2, 2.4],
                    [1.0, 1.9, 2.6, 3.3]])
    free = best_plan(exp, [0, 2, 4, 8], lambda n, groups: 0.02 + 0.0005 * n)
    costly = best_plan(exp, [0, 2, 4, 8], lambda n, groups: 0.02 + 0.0005 * n + 0.03 * groups)
    assert free[0] != free[1]
    assert costly[0] == costly[1] > 0


def test_hysteresis_prevents_flapping():
    """Acceptance wobbling around the break-even point must not flip the plan every step."""
    grid = budget_grid((0, 4))
    cost = CostModel(prior=CostPrior(a=0.010, b=0.0, c=0.002, g=0.0))  # plain 12 ms, 4 drafts 20 ms
    # break-even: E(4 drafts) = 20/12 = 1.667 tokens per step

    def run(margin, patience, wobble):
        ctl = make_controller("goodput", grid=grid, cost=cost, margin=margin, patience=patience,
                              explore_every=0, gate=False)
        ctl.expected_tokens = lambda rids: np.array([[1.0, wobble[ctl.steps % len(wobble)]]])
        levels = []
        for _ in range(60):
            levels.append(ctl.grid.index(ctl.plan(["r"])["r"]))
            ctl.steps += 1
        return levels, sum(a != b for a, b in zip(levels, levels[1:]))

    assert run(0.0, 1, [1.70, 1.64])[1] > 50  # without hysteresis the plan flaps every step
    assert run(0.05, 3, [1.70, 1.64])[1] <= 1
    # a sustained, clear gain does get through, after `patience` steps
    levels, flips = run(0.05, 3, [1.0] * 10 + [2.5] * 50)
    assert flips == 1 and levels[:12] == [0] * 12 and levels[12] == 1  # 3rd winning step


def test_goodput_explores_when_stuck_plain():
    ctl = make_controller("goodput", grid=budget_grid((0, 4)), explore_every=5, gate=False,
                          cost=CostModel(prior=CostPrior(a=0.001, b=0, c=0.01)))
    chosen = [ctl.plan(["r"])["r"].max_nodes for _ in range(10)]
    assert chosen.count(0) == 8 and chosen[4] == chosen[9] == 4


@pytest.mark.parametrize("model_says_speculate", [True, False])
def test_goodput_gate_plays_what_measures_fastest(model_says_speculate):
    """Whatever the models predict, the measured decode tokens/s decide between plain decoding,
    the models' plan and the full tree for everyone: here plain is 2x faster than any speculation
    when the models think speculation wins, and the full tree 1.5x faster than plain (a smaller
    tree in between) when they think it loses."""
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)   # verification nearly free: the model speculates
    dear = CostPrior(a=0.001, b=0.0, c=0.010)     # every token costs a step: the model stays plain
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)),
                          cost=CostModel(prior=cheap if model_says_speculate else dear))
    rids = ["a", "b"]
    for r in rids:
        for _ in range(20):
            ctl.acceptance.observe(r, 1, drafted=2, accepted=1)
    speed = {0: 100.0, 2: 50.0, 8: 50.0} if model_says_speculate else {0: 100.0, 2: 110.0, 8: 150.0}
    plans = []
    for _ in range(400):
        nodes = max(b.max_nodes for b in ctl.plan(rids).values())
        plans.append(nodes)
        tokens = 2 * (1 + min(nodes, 2))  # measured tokens/s
        ctl.observe(StepObservation(batch_size=2, tokens=2 * (1 + nodes), seconds=tokens / speed[nodes] + 0.5,
                                    decode_seconds=tokens / speed[nodes],
                                    accepted={r: min(nodes, 2) for r in rids}))
    assert (plans[0] > 0) == model_says_speculate                # the model's call until measured
    best = max(speed, key=speed.get)
    late = plans[-256:]
    assert late.count(best) >= 0.9 * len(late) and len(late) - late.count(best) >= 2  # still explores


@pytest.mark.parametrize("model_speed", [130.0, 60.0])
def test_goodput_leaves_arms_out_of_bigger_batches_once_they_lost(model_speed):
    """A full tree measured clearly slower at batch 2 is not tried again at batch 8; nor is the
    models' plan when it lost clearly too (then batch 8 decodes plainly, without exploring)."""
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)))
    speed = {0: 100.0, 2: model_speed, 8: 40.0}

    def run(rids, steps):
        played = []
        for _ in range(steps):
            nodes = max(b.max_nodes for b in ctl.plan(rids).values())
            played.append(nodes)
            tokens = len(rids) * (1 + min(nodes, 1))
            ctl.observe(StepObservation(batch_size=len(rids), tokens=len(rids) * (1 + nodes), seconds=1.0,
                                        decode_seconds=tokens / speed[nodes],
                                        accepted={r: min(nodes, 1) for r in rids}))
        return played

    small = run(["a", "b"], 100)
    assert 8 in small and 2 in small         # tried (and measured) at batch 2
    big = run([f"r{i}" for i in range(8)], 200)
    assert 8 not in big
    assert (2 in big) == (model_speed > speed[0])  # the plan won at batch 2: still played at 8


@pytest.mark.parametrize("model_vs_plain, kept", [(1.05, ("plain", "model")), (0.95, ("plain",))])
def test_goodput_bigger_batches_keep_only_arms_that_beat_plain(model_vs_plain, kept):
    """At batch 2-3 (bucket 1) plain leads, the full tree measured at 0.4x of it and the models'
    plan at 1.05x or 0.95x: from batch 4 on, only an arm that beat plain there is tried."""
    pol = make_controller("goodput", grid=budget_grid((0, 2, 8))).policy
    gate = pol.gate
    gate.leader[1] = "plain"
    for arm, ratio in (("model", model_vs_plain), ("full", 0.4)):
        x = math.log(ratio)
        gate.pairs[(1, arm)] = [10.0, 10 * x, 10 * x * x]
    assert pol._arms(2) == pol._arms(3) == kept
    assert pol._arms(1) == pol._arms(0) == GoodputPolicy.ARMS  # nothing smaller was measured


def test_goodput_asks_the_models_only_when_their_plan_is_played():
    """Planning is Python on the engine's hot path: once plain decoding leads a bucket, only the
    steps that explore the models' plan consult them, the first of each run of such steps (its
    next REPLAN_STEPS - 1 reuse that plan), and that plan is then the models' current choice (no
    hysteresis carried over from steps that played another arm)."""
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)))
    speed = {0: 100.0, 2: 60.0, 8: 40.0}  # plain is fastest at batch 4
    rids = ["a", "b", "c", "d"]
    asked, ask = [], ctl.expected_tokens
    ctl.expected_tokens = lambda r: asked.append(ctl.steps) or ask(r)
    played = []
    for _ in range(400):
        nodes = max(b.max_nodes for b in ctl.plan(rids).values())
        played.append(nodes)
        tokens = len(rids) * (1 + min(nodes, 1))
        ctl.observe(StepObservation(batch_size=4, tokens=4 * (1 + nodes), seconds=1.0,
                                    decode_seconds=tokens / speed[nodes], accepted={r: min(nodes, 1) for r in rids}))
    assert ctl.policy.gate.leader[2] == "plain"
    late = range(200, 400)
    model_steps = [s for s in late if played[s] == 2]  # the models' plan (the full tree is 8)
    assert played[200:].count(0) >= 0.9 * 200
    run_start = [s for s in model_steps if s - 1 not in model_steps]
    assert run_start and [s for s in asked if s >= 200] == [
        s for s in model_steps if (s - max(r for r in run_start if r <= s)) % REPLAN_STEPS == 0]


def test_model_arm_reuses_its_plan_for_the_same_requests_a_few_steps():
    """The models plan again every REPLAN_STEPS steps in a row, at once when the batch's requests
    change or another arm played in between."""
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)))
    policy, planned = ctl.policy, []
    plan_now = policy._speculating_plan
    policy._speculating_plan = lambda c, r, *a: planned.append(ctl.steps) or plan_now(c, r, *a)

    def play(rids, steps):
        for _ in range(steps):
            policy._model_arm(ctl, rids)
            ctl.steps += 1

    play(["a", "b"], 2 * REPLAN_STEPS + 1)
    assert planned == [0, REPLAN_STEPS, 2 * REPLAN_STEPS]
    play(["a", "c"], 2)  # a request left, another joined
    assert planned[-2:] == [2 * REPLAN_STEPS, 2 * REPLAN_STEPS + 1]
    ctl.steps += 1  # a step of another arm
    play(["a", "c"], 1)
    assert planned[-1] == ctl.steps - 1 and len(planned) == 5


def test_model_arm_prices_plans_as_the_engine_pads_them():
    """best_plan gives the budget to the request that accepts (priced per drafted node), but the
    engine pads every row to the widest tree: the plain row beside a 9-token tree costs 9 tokens
    too. Priced that way a uniform level is worth more, and the model arm plays it."""
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 4, 8)),
                          cost=CostModel(prior=CostPrior(a=0.02, b=0.0, c=0.002, e=0.0, g=0.0)))
    exp = np.array([[1.0, 1.1, 1.15, 1.2],   # drafts for "a" almost never accepted
                    [1.0, 2.9, 4.6, 6.5]])   # "b" accepts nearly everything
    ctl.expected_tokens = lambda rids: exp
    rids = ["a", "b"]
    assert best_plan(exp, ctl.used, lambda n, g: ctl.step_time(2, n, g)) == [0, 3]
    planned, model_plan = [], ctl.policy._model_plan
    ctl.policy._model_plan = lambda *a: planned.append(1) or model_plan(*a)
    plan, ratio = ctl.policy._speculating_plan(ctl, rids)
    assert len(planned) == 1  # one plan a step: it advances the hysteresis
    padded = lambda lv: ctl.predicted_goodput(rids, lv, exp, padded=True)  # noqa: E731
    assert plan == {"a": 2, "b": 2} and ratio == pytest.approx(padded([2, 2]) / padded([0, 0])) and ratio > 1
    assert padded([2, 2]) > padded([0, 3]) > padded([0, 0])
    assert ctl.predicted_goodput(rids, [0, 3], exp) > ctl.predicted_goodput(rids, [2, 2], exp)


def test_cost_follows_the_nodes_a_drafter_really_uses():
    """A drafter that fills a 12-node budget with 3 nodes costs what 3 nodes cost: the controller
    learns the nodes verified per level and prices plans with them (smaller levels capped too)."""
    ctl = make_controller("goodput", grid=budget_grid((0, 4, 12)), cost=CostModel(prior=CostPrior(a=0.02, c=0.002)))
    before = ctl.predicted_goodput(["r"], [2], np.array([[1.0, 1.5, 2.0]]))
    for _ in range(100):
        ctl.plan(["r"])
        ctl.last_plan = {"r": 2}
        ctl.observe(StepObservation(batch_size=1, tokens=4, seconds=0.026, accepted={"r": 1}, verified={"r": 4}))
    assert ctl.used[2] == pytest.approx(3.0, abs=0.1) and ctl.used[1] <= ctl.used[2]
    assert ctl.used[0] == 0.0
    assert ctl.predicted_goodput(["r"], [2], np.array([[1.0, 1.5, 2.0]])) > 1.2 * before


def test_thompson_converges_to_the_better_arm():
    pol = ThompsonPolicy(num_levels=3, seed=0)
    means = [100.0, 130.0, 90.0]  # arm 1 has the best goodput
    rng = random.Random(0)
    picks = []
    for _ in range(300):
        arm = pol.sample_arm(0)
        pol.reward(0, arm, rng.gauss(means[arm], 15.0))
        picks.append(arm)
    assert picks[-100:].count(1) >= 85


def test_thompson_is_rewarded_through_the_controller():
    ctl = make_controller("thompson", grid=budget_grid((0, 4)), seed=1)
    rng = random.Random(0)
    last = []
    for step in range(200):
        plan = ctl.plan(["a", "b"])
        nodes = plan["a"].max_nodes
        acc = 3 if nodes else 0  # speculation accepts 3 and costs little more: it wins
        secs = (0.02 + 0.001 * nodes) * (1 + 0.05 * rng.random())
        ctl.observe(StepObservation(2, 2 * (1 + nodes), secs, {"a": acc, "b": acc}, {"a": nodes, "b": nodes}))
        last.append(nodes)
    assert last[-50:].count(4) >= 45


def test_fixed_policies():
    grid = budget_grid((0, 2, 8))
    always = make_controller("always", grid=grid, fixed_nodes=2)
    assert {b.max_nodes for b in always.plan(list(range(20))).values()} == {2}
    thr = make_controller("threshold", grid=grid, disable_batch_size=4)
    assert {b.max_nodes for b in thr.plan([1, 2, 3]).values()} == {8}
    assert {b.max_nodes for b in thr.plan([1, 2, 3, 4]).values()} == {0}
    with pytest.raises(ValueError, match="unknown speculation policy"):
        make_controller("greedy")
    assert isinstance(make_controller().policy, GoodputPolicy)


def _drive_confidence(confidence_of, steps=300, seed=0):
    """Request 'r' at a 4-node chain budget: regimes of 10 easy steps (all 4 accepted), 10 hard (0)."""
    ctl = make_controller("always", grid=budget_grid((0, 4)))
    rng = random.Random(seed)
    history = []
    for step in range(steps):
        ctl.plan(["r"])
        acc = 4 if (step // 10) % 2 == 0 else 0
        ctl.observe(StepObservation(1, 5, 0.02, {"r": acc}, {"r": 4}, confidence={"r": confidence_of(acc, rng)}))
        history.append((acc, ctl.expected_tokens(["r"])[0, 1], ctl.acceptance.expected_tokens(["r"], [4])[0, 0]))
    return ctl, history


def test_calibrated_confidence_is_trusted_and_tracks_regime_changes():
    # The head's scores predict acceptance but are under-confident by 2x: calibration fixes the scale.
    ctl, history = _drive_confidence(lambda acc, rng: acc / 2 + 0.05)
    assert ctl.confidence.calibration == pytest.approx(2.0, rel=0.1)
    assert ctl.confidence.weight > 0.7
    # right after a switch to the hard regime the estimate drops at once (history alone lags)
    for step in range(200, 300, 20):
        acc, blended, history_only = history[step + 10]  # first hard step has been observed
        assert acc == 0 and blended < 2.0 < 3.0 < history_only


def test_uninformative_confidence_gets_little_weight():
    ctl, _ = _drive_confidence(lambda acc, rng: rng.random() * 4)
    assert ctl.confidence.weight < 0.4


def test_confidence_tap_sums_tree_scores_per_slot():
    import torch

    from specdec.heads.tree import DraftTree
    from specdec.infer.server.controller import ConfidenceTap

    class Fake:
        feature_spec = "spec"

        def propose(self, slots, roots, budget):
            scores = torch.tensor([[1.0, 0.9, 0.5, 0.2], [1.0, 0.3, 0.0, 0.0]])
            valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
            return DraftTree(tokens=torch.zeros(2, 4, dtype=torch.long), parents=torch.tensor([[-1, 0, 1, 1]] * 2),
                             valid=valid, scores=scores)

    tap = ConfidenceTap(Fake())
    assert tap.feature_spec == "spec"  # everything else is the wrapped drafter's
    tap.propose(torch.tensor([3, 5]), torch.tensor([1, 2]), TreeBudget(3, 2, 2))
    out = tap.take()
    assert out.keys() == {3, 5}
    assert out[3] == pytest.approx(1.6) and out[5] == pytest.approx(0.3)
    assert tap.take() == {}


def test_goodput_measures_each_request_decoding_alone_apart():
    """At batch 1 the gate's regime is the request: one whose drafts are never accepted (the full
    tree measured at half plain's speed) goes plain; the next request is measured afresh and
    speculates with the full tree where it accepts (its start is the models' call, which the
    first request taught to expect little); a released request's measurements are dropped."""
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)  # the models expect speculation to pay
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)), cost=CostModel(prior=cheap))
    gate = ctl.policy.gate

    def run(rid, accepted_per_step, steps=200):
        played = []
        for _ in range(steps):
            nodes = ctl.plan([rid])[rid].max_nodes
            played.append(nodes)
            acc = min(nodes, accepted_per_step)
            seconds = 0.010 if nodes == 0 else 0.020  # speculation costs 2x a plain step
            ctl.observe(StepObservation(batch_size=1, tokens=1 + nodes, seconds=seconds,
                                        decode_seconds=seconds, accepted={rid: acc}))
        return played

    hard = run("hard", 0)
    assert hard[0] == 8 and gate.leader[("alone", "hard")] == "plain" and hard[-100:].count(0) >= 80
    easy = run("easy", 6)  # 7 tokens in 2 plain steps' time
    assert gate.leader[("alone", "easy")] == "full" and easy[-100:].count(8) >= 80
    ctl.release("hard")
    assert ("alone", "hard") not in gate.leader and not any(k[0] == ("alone", "hard") for k in gate.pairs)


def test_goodput_starts_a_bigger_batch_plain_where_a_smaller_one_decodes_plainly():
    """A batch size never seen before starts with plain decoding when the nearest smaller batch
    size measured plain fastest, whatever the models predict; with nothing measured below, the
    models' call (here: speculate) picks the first leader."""
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)), cost=CostModel(prior=cheap))
    rids = [f"r{i}" for i in range(32)]
    assert max(b.max_nodes for b in ctl.plan(rids[:2]).values()) == 8  # bucket 1: the models' call
    ctl.policy.gate.leader[3] = "plain"  # batch 8-15 measured plain fastest
    assert max(b.max_nodes for b in ctl.plan(rids).values()) == 0
    assert ctl.policy.gate.leader[5] == "plain"


@pytest.mark.parametrize("plain_there, starts", [(0.7, 8), (0.95, 0)])
def test_goodput_starts_a_big_batch_plain_unless_a_smaller_one_measured_speculation_faster(plain_there, starts):
    """From batch 4 on, a new batch size follows the models' call (here: speculate) only where a
    smaller batch size measured speculation against plain and found it clearly faster (plain at
    most SPEC_START_LEAD of it there): a leader there by default alone (the few steps of a busy
    server's ramp) does not count, nor does a lead of a few per cent."""
    assert 0.7 < SPEC_START_LEAD < 0.95
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)
    rids = [f"r{i}" for i in range(16)]
    nodes = lambda ctl, n: max(b.max_nodes for b in ctl.plan(rids[:n]).values())  # noqa: E731
    fresh = make_controller("goodput", grid=budget_grid((0, 2, 8)), cost=CostModel(prior=cheap))
    assert nodes(fresh, 2) == 8 and nodes(fresh, 16) == 0  # bucket 1 by default only: plain at 16
    measured = make_controller("goodput", grid=budget_grid((0, 2, 8)), cost=CostModel(prior=cheap))
    assert nodes(measured, 2) == 8
    x = math.log(plain_there)  # batch 2-3 measured plain at this fraction of the full tree's speed
    measured.policy.gate.pairs[(1, "plain")] = [4.0, 4 * x, 4 * x * x]
    assert nodes(measured, 16) == starts


def test_goodput_starts_a_request_decoding_alone_from_the_ones_before_it():
    """Requests decoding alone seed the next one's gate: after four on which the full tree decodes
    1.25x faster than plain (the models' small plan 1.1x), a new request explores the other arms
    at the slow pace from its first step (without the prior it explores 3 steps in 8 until its own
    pairs are in); a request where plain decoding is faster still turns plain on its own pairs."""
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)), cost=CostModel(prior=cheap))
    pol = ctl.policy
    rate = {0: 100.0, 2: 110.0, 8: 125.0}  # tokens/s of each arm where drafts are accepted

    def run(rid, easy, steps):
        played = []
        for _ in range(steps):
            nodes = ctl.plan([rid])[rid].max_nodes
            played.append(nodes)
            accepted = {0: 0, 2: 1, 8: 2}[nodes] if easy else 0
            seconds = ({0: 0, 2: 1, 8: 2}[nodes] + 1) / rate[nodes]
            ctl.observe(StepObservation(batch_size=1, tokens=1 + nodes, seconds=seconds, decode_seconds=seconds,
                                        accepted={rid: accepted}))
        ctl.release(rid)
        return played

    first = run("r0", True, 64)
    assert first.count(8) <= 48  # learnt from scratch: 3 steps in 8 explore
    for i in range(1, 4):
        run(f"r{i}", True, 64)
    speeds, weight = pol._alone_prior()
    assert speeds["full"] == pytest.approx(math.log(1.25), abs=0.05)
    assert speeds["model"] == pytest.approx(math.log(1.10), abs=0.05)
    seeded = run("r4", True, 64)
    assert seeded.count(8) >= 58  # at the slow pace from the start
    hard = run("hard", False, 400)  # nothing accepted: plain is 2-2.5x faster for this one
    assert hard[0] == 8 and hard[-100:].count(0) >= 80


def test_goodput_regime_follows_the_load_not_its_dips():
    """Batch 4-7 decodes plainly, batch 2-3 speculates: a batch of 4 that loses a request for a
    few steps (until the client's next one is admitted) stays plain; a batch that stays at 3
    takes batch 2-3's leader once the last DIP_STEPS decisions saw no bigger batch."""
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)))
    gate = ctl.policy.gate
    gate.leader[1], gate.leader[2] = "full", "plain"
    x = math.log(0.5)  # both speculating arms measured at half plain's speed at batch 4-7
    gate.pairs[(2, "full")] = gate.pairs[(2, "model")] = [10.0, 10 * x, 10 * x * x]
    four, three = ["a", "b", "c", "d"], ["a", "b", "c"]
    nodes = lambda rids: max(b.max_nodes for b in ctl.plan(rids).values())  # noqa: E731
    assert [nodes(four) for _ in range(3)] == [0, 0, 0]
    dip = [nodes(three) for _ in range(DIP_STEPS + 1)]
    assert dip[:DIP_STEPS - 1] == [0] * (DIP_STEPS - 1) and dip[-1] == 8


@pytest.mark.parametrize("models_say_behind", [True, False])
def test_goodput_paces_a_big_batch_by_the_models_where_they_put_speculation_far_behind(models_say_behind):
    """A batch of 8 new to the gate starts plain; where the models predict both speculating arms far
    slower than plain (every verified token costs a step), they start as measured so and are tried
    at the slow arms' pace, not every 8th step until 4 pairs each trust them; where the models
    predict speculation faster, the arms start unknown and are measured at the warm-up pace."""
    dear = CostPrior(a=0.001, b=0.0, c=0.010)
    cheap = CostPrior(a=0.030, b=0.0, c=0.0001)
    ctl = make_controller("goodput", grid=budget_grid((0, 2, 8)),
                          cost=CostModel(prior=dear if models_say_behind else cheap))
    rids = [f"r{i}" for i in range(8)]
    speed = {0: 100.0, 2: 45.0, 8: 30.0}
    played = []
    for _ in range(96):
        nodes = max(b.max_nodes for b in ctl.plan(rids).values())
        played.append(nodes)
        tokens = len(rids) * (1 + min(nodes, 1))
        ctl.observe(StepObservation(batch_size=len(rids), tokens=len(rids) * (1 + nodes), seconds=1.0,
                                    decode_seconds=tokens / speed[nodes], accepted={r: min(nodes, 1) for r in rids}))
    spec = sum(n > 0 for n in played)
    assert played[0] == 0 and ctl.policy.gate.leader[3] == "plain"
    if models_say_behind:
        speeds, weight = ctl.policy.gate.priors[3]
        assert weight == 2.0 and speeds["plain"] == 0.0
        assert math.exp(speeds["model"]) < 0.7 and math.exp(speeds["full"]) < 0.3
        assert 0 < spec <= 6   # the first run of each arm, then the slow arms' pace
    else:
        assert 3 not in ctl.policy.gate.priors
        assert spec >= 15      # 3 steps in every 8 until each arm has its pairs


def test_cpu_prior_prices_verified_tokens_that_plain_steps_cannot():
    """Plain steps alone (one token a sequence) cannot split a step's cost between sequences and
    tokens: the prior's split stays. With plain steps timed as on the 2-core CPU, the CPU prior
    prices a 9-token tree per row at batch 16 at ~4.8 plain steps, the GPU-like default at ~2.6."""
    from specdec.infer.server.costmodel import CPU_PRIOR, default_prior

    assert default_prior("cpu") is CPU_PRIOR and default_prior("cuda:0") == CostPrior()
    ratios = {}
    for name, prior in (("cpu", CPU_PRIOR), ("default", CostPrior())):
        cost = CostModel(prior=prior)
        for b in (8, 12, 16, 16, 24, 32) * 20:
            cost.observe(b, b, 0.010 + 0.0007 * b)
        ratios[name] = cost.predict(16, 16 * 9, 0, 1) / cost.predict(16, 16)
    assert ratios["cpu"] > 4.0 > 3.0 > ratios["default"]
