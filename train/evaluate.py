"""Held-out evaluation of a draft head: acceptance per depth, expected accepted length, calibration.

Everything comes from ``head.acceptance(batch, depth)`` (teacher-forced chains, see
``specdec.heads.base.acceptance_stats``): ``correct[d]`` counts chains whose drafts at depths
1..d+1 all equal the target's greedy tokens, ``count[d]`` the chains scored at that depth.
So ``p_k = correct[k-1] / count[k-1]`` is P(accepted length >= k), the conditional
acceptance is ``a_k = p_k / p_{k-1}`` and, for a greedy chain of K drafts,

    tau = 1 + sum_k prod_{j<=k} a_j = 1 + sum_k p_k

(the 1 is the token the target adds every step). Calibration bins the draft's top-1
confidence at every prediction made after an accepted prefix and compares it with the hit
rate; ECE = sum_b n_b / N * |mean confidence_b - hit rate_b|.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass
class EvalResult:
    depth: int
    correct: list[int]
    count: list[int]
    reach: list[float]  # p_k = P(accepted length >= k), k = 1..depth
    acceptance: list[float]  # a_k, conditional on depths 1..k-1 accepted
    tau: float  # expected tokens per step of a greedy chain of `depth` drafts
    ece: float
    calibration: list[dict] = field(default_factory=list)  # per bin: lo, hi, n, confidence, hit_rate
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # mean of head.loss metrics
    num_sequences: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def flat_metrics(self, prefix: str = "eval/") -> dict[str, float]:
        """Scalars for wandb / metrics.jsonl."""
        out = {f"{prefix}tau": self.tau, f"{prefix}ece": self.ece}
        for k, (p, a) in enumerate(zip(self.reach, self.acceptance), start=1):
            out[f"{prefix}acc@{k}"] = a
            out[f"{prefix}reach@{k}"] = p
        if self.loss is not None:
            out[f"{prefix}loss"] = self.loss
        out.update({f"{prefix}{k}": v for k, v in self.metrics.items()})
        return out


def expected_accepted_length(acceptance: list[float]) -> float:
    """tau = 1 + sum_k prod_{j<=k} a_j for conditional acceptances a_1..a_K."""
    tau, survive = 1.0, 1.0
    for a in acceptance:
        survive *= a
        tau += survive
    return tau


def conditional_acceptance(correct, count) -> tuple[list[float], list[float]]:
    """(reach p_k, conditional a_k) from per-depth counts."""
    reach = [float(c) / float(n) if n else 0.0 for c, n in zip(correct, count)]
    acc, prev = [], 1.0
    for p in reach:
        acc.append(p / prev if prev > 0 else 0.0)
        prev = p
    return reach, acc


def calibration_sums(confidence, hit, bins: int = 10) -> torch.Tensor:
    """[bins, 3] per-bin (count, sum of confidence, sum of hits): summable across processes."""
    conf = torch.as_tensor(confidence, dtype=torch.float64).flatten()  # [N]
    hits = torch.as_tensor(hit, dtype=torch.float64).flatten()  # [N]
    idx = (conf * bins).long().clamp(0, bins - 1)  # confidence 1.0 goes to the top bin
    out = torch.zeros(bins, 3, dtype=torch.float64)
    out[:, 0].index_add_(0, idx, torch.ones_like(conf))
    out[:, 1].index_add_(0, idx, conf)
    out[:, 2].index_add_(0, idx, hits)
    return out


def calibration_table(sums: torch.Tensor) -> tuple[list[dict], float]:
    """Bins and expected calibration error from summed [bins, 3] statistics."""
    bins = sums.shape[0]
    total = float(sums[:, 0].sum())
    rows, ece = [], 0.0
    for b in range(bins):
        n, c, h = (float(x) for x in sums[b])
        if n == 0:
            continue
        conf, rate = c / n, h / n
        ece += n / total * abs(conf - rate)
        rows.append({"lo": b / bins, "hi": (b + 1) / bins, "n": int(n), "confidence": conf, "hit_rate": rate})
    return rows, ece


@torch.no_grad()
def evaluate(head, batches, depth: int, gather=None, loss_kwargs: dict | None = None,
             bins: int = 10) -> EvalResult:
    """Run ``head.acceptance`` and ``head.loss`` over ``batches``.

    ``gather(obj) -> list`` collects one object from every process (e.g. a wrapper of
    ``torch.distributed.all_gather_object``); every process must call evaluate, even one whose
    shard of the eval set is empty.
    """
    local = {"correct": torch.zeros(depth, dtype=torch.float64),
             "count": torch.zeros(depth, dtype=torch.float64),
             "calib": torch.zeros(bins, 3, dtype=torch.float64),
             "loss": 0.0, "metrics": {}, "batches": 0, "sequences": 0}
    was_training = head.training
    head.eval()
    try:
        for batch in batches:
            stats = head.acceptance(batch, depth)
            local["correct"] += torch.as_tensor(stats["correct"], dtype=torch.float64)[:depth]
            local["count"] += torch.as_tensor(stats["count"], dtype=torch.float64)[:depth]
            local["calib"] += calibration_sums(stats["confidence"], stats["hit"], bins)
            loss, metrics = head.loss(batch, **(loss_kwargs or {}))
            local["loss"] += float(loss)
            for k, v in metrics.items():
                local["metrics"][k] = local["metrics"].get(k, 0.0) + float(v)
            local["batches"] += 1
            local["sequences"] += int(batch["input_ids"].shape[0])
    finally:
        head.train(was_training)
    parts = gather(local) if gather is not None else [local]
    correct = sum(p["correct"] for p in parts)
    count = sum(p["count"] for p in parts)
    calib = sum(p["calib"] for p in parts)
    n_batches = sum(p["batches"] for p in parts)
    metric_sums: dict[str, float] = {}
    for p in parts:
        for k, v in p["metrics"].items():
            metric_sums[k] = metric_sums.get(k, 0.0) + v
    reach, acc = conditional_acceptance(correct.tolist(), count.tolist())
    rows, ece = calibration_table(calib)
    return EvalResult(
        depth=depth, correct=[int(x) for x in correct], count=[int(x) for x in count],
        reach=reach, acceptance=acc, tau=expected_accepted_length(acc), ece=ece, calibration=rows,
        loss=sum(p["loss"] for p in parts) / n_batches if n_batches else None,
        metrics={k: v / n_batches for k, v in metric_sums.items()} if n_batches else {},
        num_sequences=sum(p["sequences"] for p in parts))


def format_table(result: EvalResult) -> str:
    """A small text table: acceptance per depth, tau, calibration."""
    lines = [f"eval on {result.num_sequences} held-out sequences"
             + (f", loss {result.loss:.4f}" if result.loss is not None else ""),
             "depth  reach(P[len>=k])  acceptance(cond.)  correct/count"]
    for k in range(result.depth):
        lines.append(f"{k + 1:>5}  {result.reach[k]:>16.3f}  {result.acceptance[k]:>17.3f}  "
                     f"{result.correct[k]}/{result.count[k]}")
    lines.append(f"expected accepted length tau (chain of {result.depth}) = {result.tau:.3f}")
    lines.append(f"calibration: ECE = {result.ece:.4f}")
    lines.append("  confidence bin   n      mean conf  hit rate")
    for row in result.calibration:
        lines.append(f"  [{row['lo']:.1f}, {row['hi']:.1f})  {row['n']:>6}  {row['confidence']:>9.3f}  "
                     f"{row['hit_rate']:>8.3f}")
    return "\n".join(lines)
