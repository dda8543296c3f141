"""What the speculation controller measures: step cost and per-request acceptance.

* ``CostModel`` predicts the wall time of one engine step (draft + verify +
  commit) from batch size B, total tokens verified N, prompt tokens prefilled
  in the same step P, and the number G of distinct draft budgets (the engine
  calls the drafter once per distinct budget):

      t = a + b·B + c·N (+ d·N²) + e·P + g·G

  fitted online by ridge regression over a window of recent ``Engine.last_step``
  timings, shrunk toward a prior so it gives sane answers from the very first
  step (and along directions the data cannot separate: with speculation off,
  N == B for every observation, so b and c are only told apart by the prior).
* ``AcceptanceTracker`` estimates, per request and per draft position d, the
  probability that draft token d is accepted given d-1 were (a running,
  exponentially-forgotten average), shrunk toward the same estimate pooled over
  all requests at the same budget level (wider trees accept more per position).
  Expected tokens per step at a budget of depth D:
      E(D) = 1 + Σ_{d=1..D} Π_{i<=d} α_i          (1 = the token the target adds)
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Feature scales keep the ridge penalty comparable across terms: 1, B, N, N², P, G.
_SCALES = np.array([1.0, 8.0, 64.0, 64.0 ** 2, 256.0, 1.0])
_TERMS = ("a", "b", "c", "d", "e", "g")
_QUADRATIC = 3  # index of the N² term


@dataclass
class CostPrior:
    """Seconds per step, per sequence, per verified token, per token², per prefill token, per draft call."""

    a: float = 0.02
    b: float = 0.0005
    c: float = 0.0003
    d: float = 0.0
    e: float = 0.0003
    g: float = 0.002

    def scaled(self) -> np.ndarray:  # [6] coefficients on the scaled features
        return np.array([getattr(self, t) for t in _TERMS]) * _SCALES


# A CPU computes every verified token: the 2-core AVX-512 machine (bf16, SmolLM2-135M) decodes one
# token in ~10.5 ms and batch 16 in 20-28 ms, verifies 13 tokens in 15-20 ms and a full tree at batch 16
# (208 tokens) in 130-140 ms: ~0.6 ms a token, little per sequence beyond it. With speculation off the
# data cannot split per-sequence from per-token cost (N == B), so the prior's split stays: the default
# one (GPU-like: tokens nearly free) had the models of a fresh server put the full tree at 0.89x plain at
# batch 16 (measured ~0.2x), and the gate then explored it (docs/BENCHMARKS.md, session 37).
CPU_PRIOR = CostPrior(a=0.010, b=0.0001, c=0.0006, e=0.0006, g=0.003)


def default_prior(device) -> CostPrior:
    """The cost prior for a device: ``CPU_PRIOR`` on a CPU, else the default (GPU-like) one."""
    return CPU_PRIOR if str(device).startswith("cpu") else CostPrior()


class CostModel:
    """Online least-squares model of one step's wall time."""

    def __init__(self, prior: CostPrior | None = None, window: int = 512, prior_weight: float = 0.25,
                 quadratic: bool = False, decay: float = 0.995):
        self.prior = prior or CostPrior()
        self.window = window
        self.prior_weight = prior_weight  # how many observations the prior is worth per term
        self.quadratic = quadratic
        self.decay = decay  # recency weight per observation: a busy machine changes speed
        self.obs: deque[tuple[float, ...]] = deque(maxlen=window)  # (B, N, P, G, seconds)
        self._set_theta(self.prior.scaled())
        self._dirty = False

    @staticmethod
    def _features(batch, tokens, prefill=0, groups=0) -> np.ndarray:  # [..., 6]
        b, n, p, g = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (batch, tokens, prefill, groups)))
        return np.stack([np.ones_like(b), b, n, n * n, p, g], axis=-1) / _SCALES

    def observe(self, batch: int, tokens: int, seconds: float, prefill: int = 0, groups: int = 0) -> None:
        if batch <= 0 or tokens <= 0 or not np.isfinite(seconds) or seconds <= 0:
            return  # a step without decoding says nothing about decode cost
        self.obs.append((float(batch), float(tokens), float(prefill), float(groups), float(seconds)))
        self._dirty = True

    def coefficients(self) -> dict[str, float]:
        """The fitted terms in natural units (seconds per step / sequence / token / token² / ...)."""
        self._fit()
        return dict(zip(_TERMS, self._natural))

    def predict(self, batch, tokens, prefill=0, groups=0):
        """Predicted seconds of a step (arrays broadcast)."""
        theta = self._fit()
        if all(isinstance(x, (int, float)) for x in (batch, tokens, prefill, groups)):
            # The controller asks ~15 scalar predictions a step: in plain floats 2 us each,
            # through numpy's broadcasting 40 (0.6 of its ~1.2 ms a step at batch 4).
            a, b, c, d, e, g = self._natural
            return max(a + b * batch + c * tokens + d * tokens * tokens + e * prefill + g * groups, 1e-5)
        t = self._features(batch, tokens, prefill, groups) @ theta
        return np.maximum(t, 1e-5) if np.ndim(t) else max(float(t), 1e-5)

    def _fit(self) -> np.ndarray:
        if not self._dirty:
            return self._theta
        data = np.array(self.obs)  # [n, 5] B, N, P, G, seconds
        x = self._features(data[:, 0], data[:, 1], data[:, 2], data[:, 3])  # [n, 6]
        y = data[:, 4]
        w = self.decay ** np.arange(len(y) - 1, -1, -1)  # newest observation weighs 1
        prior = self.prior.scaled()
        keep = np.ones(len(_TERMS), dtype=bool)
        keep[_QUADRATIC] = self.quadratic
        x, prior = x[:, keep], prior[keep]
        # Ridge toward the prior, penalty relative to each feature's typical size so the prior
        # is worth ``prior_weight`` observations along every direction (P and G are often all
        # zero: then only the prior speaks for them).
        lam = self.prior_weight * np.maximum((x ** 2).mean(axis=0), 1e-2)
        lhs = (x * w[:, None]).T @ x + np.diag(lam)
        rhs = (x * w[:, None]).T @ y + lam * prior
        theta = np.linalg.solve(lhs, rhs)
        # Costs cannot decrease with more work; a negative slope is noise over a narrow range.
        theta = np.maximum(theta, 0.0)
        full = np.zeros(len(_TERMS))
        full[keep] = theta
        self._set_theta(full)
        self._dirty = False
        return self._theta

    def _set_theta(self, theta: np.ndarray) -> None:
        """The coefficients on the scaled features, and the same per natural unit (plain floats
        for ``predict``'s scalar path and ``coefficients``)."""
        self._theta = theta
        self._natural = tuple(float(v) for v in theta / _SCALES)

    # --- persistence (--cost-profile) ---------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "specdec-cost-model/2", "quadratic": self.quadratic,
                "prior": vars(self.prior), "coefficients": self.coefficients(),
                "observations": [list(o) for o in self.obs]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> "CostModel":
        """Rebuild from a saved profile: the saved fit becomes the prior, observations are kept."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read cost profile {path}: {err}") from err
        if data.get("format") != "specdec-cost-model/2":
            raise ValueError(f"{path} is not a specdec cost profile (format {data.get('format')!r})")
        coef = data["coefficients"]
        kwargs.setdefault("quadratic", bool(data.get("quadratic", False)))
        model = cls(prior=CostPrior(**{k: float(coef[k]) for k in _TERMS}), **kwargs)
        for b, n, p, g, s in data.get("observations", [])[-model.window:]:
            model.observe(int(b), int(n), float(s), int(p), int(g))
        return model


class AcceptanceTracker:
    """Running per-position acceptance rates, per request and pooled per budget level."""

    def __init__(self, max_depth: int, num_levels: int, prior: float = 0.6,
                 request_decay: float = 0.9, global_decay: float = 0.99, shrink: float = 4.0):
        self.max_depth = max_depth
        self.prior = prior  # α before any evidence: optimistic enough to try speculating
        self.request_decay, self.global_decay, self.shrink = request_decay, global_decay, shrink
        # pooled over requests, per level: hits and trials per position  [levels, depth]
        self.g_hits = np.zeros((num_levels, max_depth))
        self.g_trials = np.zeros((num_levels, max_depth))
        self.r_hits: dict[object, np.ndarray] = {}  # request -> [depth]
        self.r_trials: dict[object, np.ndarray] = {}

    def observe(self, rid, level: int, drafted: int, accepted: int) -> None:
        """A step where ``rid`` had ``drafted`` draft positions (depth) and ``accepted`` of them passed.

        Positions 1..accepted were accepted; position accepted+1 (if drafted) was
        rejected; deeper positions were never tested (censored), so they get no trial.
        """
        drafted = min(int(drafted), self.max_depth)
        if drafted <= 0:
            return
        accepted = max(0, min(int(accepted), drafted))
        tested = min(accepted + 1, drafted)
        hits = np.zeros(self.max_depth)
        trials = np.zeros(self.max_depth)
        hits[:accepted] = 1.0
        trials[:tested] = 1.0
        rh = self.r_hits.setdefault(rid, np.zeros(self.max_depth))
        rt = self.r_trials.setdefault(rid, np.zeros(self.max_depth))
        rh *= self.request_decay
        rt *= self.request_decay
        rh += hits
        rt += trials
        self.g_hits[level] = self.g_hits[level] * self.global_decay + hits
        self.g_trials[level] = self.g_trials[level] * self.global_decay + trials

    def forget(self, rid) -> None:
        self.r_hits.pop(rid, None)
        self.r_trials.pop(rid, None)

    def pooled_rates(self) -> np.ndarray:  # [depth] over all levels, for metrics
        hits, trials = self.g_hits.sum(0), self.g_trials.sum(0)
        return (hits + self.shrink * self.prior) / (trials + self.shrink)

    def level_rates(self) -> np.ndarray:  # [levels, depth]
        # A level never tried borrows the pooled rate; the pooled rate borrows the prior.
        pooled = self.pooled_rates()
        return (self.g_hits + self.shrink * pooled) / (self.g_trials + self.shrink)

    def expected_tokens(self, rids, depths) -> np.ndarray:
        """[R, L]: expected tokens added per step for each request at each level's depth."""
        g = self.level_rates()  # [L, D]
        out = np.empty((len(rids), len(depths)))
        for i, rid in enumerate(rids):
            h = self.r_hits.get(rid)
            t = self.r_trials.get(rid)
            if h is None:
                rates = g
            else:  # the request's own history, shrunk toward the pool at each level
                rates = (h[None] + self.shrink * g) / (t[None] + self.shrink)
            cum = np.cumprod(rates, axis=1)  # [L, D] P(positions 1..d all accepted)
            for j, depth in enumerate(depths):
                out[i, j] = 1.0 + cum[j, :depth].sum()
        return out


class ConfidenceBlend:
    """Blend the drafter's own confidence into a request's acceptance estimate, where it predicts.

    A tree's scores are cumulative draft probabilities, so Σ of its non-root
    scores is the expected number of accepted drafts *if the head is calibrated*.
    Calibration is learned online (observed accepted / Σ scores, same step), and
    the confidence of a request's latest tree predicts its next step (the region
    being easy or hard to draft). Both that prediction and the running history
    average are scored against what is then accepted; they are mixed with
    inverse-squared-error weights, so a drafter whose scores say nothing (or an
    uncalibrated one) gets little weight, and one that tracks acceptance gets much.
    """

    def __init__(self, decay: float = 0.98, min_evidence: float = 8.0):
        self.decay, self.min_evidence = decay, min_evidence
        self.num = self.den = 0.0  # discounted Σ accepted, Σ confidence (calibration = num / den)
        self.err_hist = self.err_conf = 0.0  # discounted squared errors of the two predictors
        self.samples = 0.0
        self.latest: dict[object, tuple[int, float]] = {}  # request -> (level, Σ scores) of its last tree

    @property
    def calibration(self) -> float:
        return self.num / self.den if self.den > 0 else 1.0

    @property
    def weight(self) -> float:
        """Share of the confidence predictor in the blend (0 until there is evidence for it)."""
        if self.den < self.min_evidence or self.samples < self.min_evidence:
            return 0.0
        return self.err_hist / max(self.err_hist + self.err_conf, 1e-9)

    def observe(self, rid, level: int, accepted: int, hist_pred: float, confidence: float | None) -> None:
        """``hist_pred``: accepted drafts the history predicted for this step, before updating."""
        prev = self.latest.get(rid)
        if prev is not None and prev[0] == level and self.den > 0:
            conf_pred = self.calibration * prev[1]
            self.err_conf = self.err_conf * self.decay + (conf_pred - accepted) ** 2
            self.err_hist = self.err_hist * self.decay + (hist_pred - accepted) ** 2
            self.samples = self.samples * self.decay + 1.0
        if confidence is not None:
            self.num = self.num * self.decay + accepted
            self.den = self.den * self.decay + confidence
            self.latest[rid] = (level, confidence)

    def adjust(self, rid, expected: np.ndarray) -> np.ndarray:
        """expected [L] tokens per step from history -> blended with the confidence prediction."""
        w, prev = self.weight, self.latest.get(rid)
        if w == 0.0 or prev is None:
            return expected
        level, conf = prev
        hist = max(expected[level] - 1.0, 1e-3)
        # Confidence speaks for the level it was measured at; other levels keep history's shape.
        scale = float(np.clip(self.calibration * conf / hist, 0.02, 50.0))
        return (1 - w) * expected + w * (1.0 + (expected - 1.0) * scale)

    def forget(self, rid) -> None:
        self.latest.pop(rid, None)
