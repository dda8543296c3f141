"""A choice between arms by measured tokens per second, per *regime* of the situation: do the
extra work (speculate at all, speculate with the full tree) or not.

The server's goodput policy asks it whether the batch decodes plainly, speculates as its
models plan, or speculates with the full tree (regimes = batch-size buckets). Neither answer is
known in advance, so the gate measures: per regime it keeps decayed sums of tokens and seconds
for each arm (``record``: the step's decode time), plays the arm with the most tokens per
second, tries arms it has too few samples of first, and replays the others every
``explore``-th decision of a regime so a change (longer contexts, other prompts) is seen.
Outputs never depend on the gate: it only changes what is drafted and verified.
"""
from __future__ import annotations


class ThroughputGate:
    """``choose(regime) -> arm`` each step, then ``record(regime, arm, tokens, seconds)``.

    arms: the choices, cheapest first (default: False = skip the work, True = do it);
    decay: weight of the past per new sample (0.9: about the last 10 steps of an arm count);
    min_samples: samples of an arm before its rate is trusted; explore: every explore-th decision
    of a regime starts ``run`` decisions of an arm that is behind (the others in turn; an arm
    clearly, < ``clear`` x, behind only every 4th time); warmup_explore: the same period while
    some arm still lacks samples (default ``explore``). The first step after a switch is not
    sampled: it pays the switch (a drafter catching up on the tokens it skipped), not the
    arm's steady rate.
    """

    def __init__(self, decay: float = 0.9, min_samples: int = 3, explore: int = 16, run: int = 2,
                 clear: float = 0.8, arms: tuple = (False, True), warmup_explore: int | None = None):
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ValueError(f"a gate needs at least two distinct arms, got {arms!r}")
        self.decay, self.min_samples = decay, min_samples
        self.explore, self.run, self.clear, self.arms = explore, run, clear, tuple(arms)
        self.warmup_explore = warmup_explore or explore
        self.tokens: dict[tuple, float] = {}
        self.seconds: dict[tuple, float] = {}
        self.samples: dict[tuple, int] = {}
        self.decisions: dict[int, int] = {}
        self._last_arm = None
        self._skip = False  # the step in flight follows a switch: do not sample it

    def rate(self, regime: int, arm) -> float | None:
        """Decayed tokens per second of an arm in a regime (None before min_samples)."""
        key = (regime, arm)
        if self.samples.get(key, 0) < self.min_samples or self.seconds.get(key, 0.0) <= 0:
            return None
        return self.tokens[key] / self.seconds[key]

    def choose(self, regime: int, default=None, allowed=None):
        """This step's arm.

        Until every arm has ``min_samples`` here, ``default`` (e.g. what a model predicts) is
        played and the others are tried in the exploration runs; with no default, the arm doing
        most work that is short of samples is tried first. ``allowed``: a subset of the arms to
        choose from this time (what is known not to pay can be left out)."""
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        arms = [a for a in self.arms if allowed is None or a in allowed]
        rates = {a: self.rate(regime, a) for a in arms}
        unknown = [a for a in arms if rates[a] is None]
        if len(arms) == 1:  # nothing to choose or explore
            arm = arms[0]
        elif not unknown:
            arm = max(reversed(arms), key=lambda a: rates[a])  # ties: the arm doing more work
            arm = self._explored(n, arm, arms, rates) or arm
        elif default is not None and default in arms:
            arm = self._explored(n, default, arms, rates, unknown) or default
        else:
            arm = unknown[-1]
        self._skip = self._last_arm is not None and arm != self._last_arm
        self._last_arm = arm
        return arm

    def _explored(self, n: int, played, arms: list, rates: dict, unknown: list | None = None):
        """The arm an exploration run plays at decision n, or None outside the runs."""
        every = self.warmup_explore if unknown else self.explore
        if n % every < every - self.run:
            return None
        others = [a for a in (unknown or arms) if a != played] or [a for a in arms if a != played]
        k = n // every
        arm = others[k % len(others)]
        known = rates.get(arm) is not None and rates.get(played) is not None
        behind = known and rates[arm] < self.clear * rates[played]
        return None if behind and (k // len(others)) % 4 else arm

    def record(self, regime: int, arm, tokens: float, seconds: float) -> None:
        """The step's sample: tokens it added in ``seconds`` (not sampled after a switch)."""
        skip, self._skip = self._skip, False
        if skip or tokens <= 0 or seconds <= 0:
            return
        key = (regime, arm)
        self.tokens[key] = self.decay * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = self.decay * self.seconds.get(key, 0.0) + seconds
        self.samples[key] = self.samples.get(key, 0) + 1


__all__ = ["ThroughputGate"]
