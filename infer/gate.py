"""A choice between arms by measured tokens per second, per *regime* of the situation: do the
extra work (draft with the head, speculate at all, speculate with the full tree) or not.

Used twice: the hybrid drafter asks whether its trained head drafts this step (a head costs
~9-12 ms per step on the 2-core CPU next to a ~27 ms verification, retrieval ~nothing; regimes =
how much retrieval already offers), and the server's goodput policy asks whether the batch
decodes plainly, speculates as its models plan, or speculates with the full tree (regimes =
batch-size buckets). Neither answer is known in advance, so the gate measures: per regime it
keeps decayed sums of tokens and seconds for each arm, plays the arm with the most tokens per
second, tries arms it has too few samples of first, and replays the others every
``explore``-th decision of a regime so a change (longer contexts, other prompts) is seen.

Samples come either from ``record(regime, arm, tokens, seconds)`` (the server: decode time
only) or from the built-in clock: a step runs from ``choose`` to ``close`` (or the next
``choose``) with the tokens reported by ``add_tokens`` in between, and ``interrupt`` (a
prefill) voids it. Outputs never depend on the gate: it only changes what is drafted and verified.
"""
from __future__ import annotations

import time


class ThroughputGate:
    """``choose(regime) -> arm`` each step, then either ``record(...)`` or (clock mode)
    ``add_tokens(n)`` on commit and ``close()`` when the step's work is done (or ``interrupt()``
    on a prefill; otherwise the next ``choose`` closes it).

    arms: the choices, cheapest first (default: False = skip the work, True = do it);
    decay: weight of the past per new sample (0.9: about the last 10 steps of an arm count);
    min_samples: samples of an arm before its rate is trusted; explore: every explore-th decision
    of a regime starts ``run`` decisions of an arm that is behind (the others in turn; an arm
    clearly, < ``clear`` x, behind only every 4th time); warmup_explore: the same period while
    some arm still lacks samples (default ``explore``); margin: a ``default`` arm (e.g. what a
    model predicts) keeps being played unless another measures more than (1 + margin) x faster,
    so noisy samples (accepted tokens vary a lot from step to step) do not overrule a sound
    prediction while a gross error still is. The first step after a switch is not
    sampled: it pays the switch (a head catching up on the tokens it skipped), not the arm's
    steady rate. clock: for tests.
    """

    def __init__(self, decay: float = 0.9, min_samples: int = 3, explore: int = 16, run: int = 2,
                 clear: float = 0.8, arms: tuple = (False, True), warmup_explore: int | None = None,
                 margin: float = 0.0, clock=time.perf_counter):
        if len(arms) < 2 or len(set(arms)) != len(arms):
            raise ValueError(f"a gate needs at least two distinct arms, got {arms!r}")
        self.decay, self.min_samples, self.clock = decay, min_samples, clock
        self.explore, self.run, self.clear, self.arms = explore, run, clear, tuple(arms)
        self.warmup_explore, self.margin = warmup_explore or explore, margin
        self.tokens: dict[tuple, float] = {}
        self.seconds: dict[tuple, float] = {}
        self.samples: dict[tuple, int] = {}
        self.decisions: dict[int, int] = {}
        self._last_arm = None
        self._skip = False  # the step in flight follows a switch: do not sample it
        self._open: tuple | None = None  # (regime, arm, start) of the running step
        self._open_tokens = 0

    def rate(self, regime: int, arm) -> float | None:
        """Decayed tokens per second of an arm in a regime (None before min_samples)."""
        key = (regime, arm)
        if self.samples.get(key, 0) < self.min_samples or self.seconds.get(key, 0.0) <= 0:
            return None
        return self.tokens[key] / self.seconds[key]

    def choose(self, regime: int, default=None, allowed=None):
        """Close the previous clocked step's sample, then pick this step's arm.

        Until every arm has ``min_samples`` here, ``default`` (e.g. what a model predicts) is
        played and the others are tried in the exploration runs; with no default, the arm doing
        most work that is short of samples is tried first. ``allowed``: a subset of the arms to
        choose from this time (what is known not to pay can be left out)."""
        now = self.clock()
        self._close(now)
        n = self.decisions[regime] = self.decisions.get(regime, 0) + 1
        arms = [a for a in self.arms if allowed is None or a in allowed]
        rates = {a: self.rate(regime, a) for a in arms}
        unknown = [a for a in arms if rates[a] is None]
        if not unknown:
            arm = max(reversed(arms), key=lambda a: rates[a])  # ties: the arm doing more work
            if default in rates and rates[default] * (1.0 + self.margin) >= rates[arm]:
                arm = default
            arm = self._explored(n, arm, arms, rates) or arm
        elif default is not None and default in arms:
            arm = self._explored(n, default, arms, rates, unknown) or default
        else:
            arm = unknown[-1]
        self._skip = self._last_arm is not None and arm != self._last_arm
        self._last_arm = arm
        self._open, self._open_tokens = (regime, arm, now), 0
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
        """An externally timed sample (the clock is then not used: no ``add_tokens``)."""
        self._open = None
        skip, self._skip = self._skip, False
        if skip or tokens <= 0 or seconds <= 0:
            return
        key = (regime, arm)
        self.tokens[key] = self.decay * self.tokens.get(key, 0.0) + tokens
        self.seconds[key] = self.decay * self.seconds.get(key, 0.0) + seconds
        self.samples[key] = self.samples.get(key, 0) + 1

    def add_tokens(self, n: int) -> None:
        self._open_tokens += n

    def close(self) -> None:
        """The clocked step's work is done: record its sample now (not at the next ``choose``)."""
        self._close(self.clock())

    def interrupt(self) -> None:
        """Something other than a decode step happened (a prefill): drop the open sample."""
        self._open = None

    def _close(self, now: float) -> None:
        if self._open is None or self._open_tokens == 0:
            self._open = None
            return
        regime, arm, start = self._open
        self.record(regime, arm, self._open_tokens, now - start)


__all__ = ["ThroughputGate"]
