"""Spec-Bench's method (Xia et al., 2024), run on specdec's engine and on HF ``generate()``.

Protocol (as in hemingkx/Spec-Bench ``evaluation/eval.py`` + ``speed.py``):
  * batch 1, greedy, the target's chat template; a question's turns are asked in order, each
    after the previous turn's answer (decoded, special tokens dropped, stripped) was appended
    to the conversation, so turn 2's prompt holds the method's own turn-1 answer;
  * wall time per turn covers the whole ``generate`` call (prefill included);
  * speed of a question = its new tokens (all turns) / its wall time (all turns);
    tokens_per_s = the mean of those speeds; speedup = tokens_per_s of a method / that of plain
    decoding in this runtime on the same questions and run (``speedup_vs_hf``: / that of HF
    ``generate()``, the method named ``hf``, always run as the reference baseline);
  * tau = the mean over all decoding steps of the tokens a step added (accepted drafts + 1);
  * identical_rate = the share of questions whose every turn's tokens equal plain decoding's.
Each method first answers the first question once untimed (warm-up); ``runs`` > 1 repeats the
timed pass and reports mean and sample std over runs. Unlike Spec-Bench, the methods take turns
question by question (see ``run_benchmark``), so a machine's drift does not bias the speedups.
"""
from __future__ import annotations

import itertools
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DEFAULT_QUESTIONS = Path(__file__).resolve().parent / "assets" / "question.jsonl"
HF, PLAIN = "hf", "plain"
METRICS = ("tau", "tokens_per_s", "speedup", "speedup_vs_hf", "identical_rate")


class BenchError(ValueError):
    """Bad benchmark input (question file, method list, categories); the message says which."""


# ---------------------------------------------------------------------------- inputs


def load_questions(path=None, categories=None, limit: int | None = None) -> list[dict]:
    """Questions of ``path`` (default: the shipped Spec-Bench file), filtered to ``categories``
    (in the file's order); ``limit`` N keeps N questions in all, taken round-robin over the
    chosen categories (first of each category, then second of each, ...), so a small N still
    covers every category. Example: cats a (a1 a2) and b (b1), N = 3 -> a1, b1, a2."""
    path = Path(path or DEFAULT_QUESTIONS)
    if not path.exists():
        raise BenchError(f"question file {path} does not exist")
    by_cat: dict[str, list[dict]] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:  # a folder, unreadable, or not UTF-8 text
        raise BenchError(f"question file {path}: cannot read it as UTF-8 JSONL ({err})") from None
    for line_no, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            if not isinstance(q, dict):
                raise ValueError(f"expected a JSON object with 'turns', got {type(q).__name__}")
            turns = q["turns"]
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns) or not turns:
                raise ValueError("'turns' must be a non-empty list of strings")
        except (json.JSONDecodeError, KeyError, ValueError, TypeError) as err:
            raise BenchError(f"{path}:{line_no}: not a Spec-Bench question ({err})") from err
        q.setdefault("question_id", line_no)
        by_cat.setdefault(str(q.get("category", "default")), []).append(q)
    if categories:
        unknown = [c for c in categories if c not in by_cat]
        if unknown:
            raise BenchError(f"unknown categories {unknown}; {path.name} has: {', '.join(by_cat)}")
        by_cat = {c: qs for c, qs in by_cat.items() if c in set(categories)}
    if limit is None:
        chosen = [q for qs in by_cat.values() for q in qs]
    else:
        if limit < 1:
            raise BenchError(f"--limit must be >= 1, got {limit}")
        rr = (q for group in itertools.zip_longest(*by_cat.values()) for q in group if q is not None)
        chosen = list(itertools.islice(rr, limit))
    if not chosen:
        raise BenchError(f"{path} holds no questions for the chosen categories")
    return chosen


@dataclass
class MethodSpec:
    """One entry of ``--methods``: ``name`` or ``name=VALUE`` (a head folder, or what the
    training-free drafter module declares as its VALUE_OPTION, e.g. rest's datastore)."""

    name: str
    value: str | None = None
    label: str = ""

    def llm_kwargs(self) -> dict:
        """Keyword arguments for ``LLM(method=..., ...)``."""
        from specdec.infer.drafters import head_methods, training_free_methods

        if self.value is None:
            return {"method": self.name}
        if self.name in head_methods():
            return {"method": self.name, "head": self.value}
        if self.name in training_free_methods():
            import importlib

            module = importlib.import_module(f"specdec.infer.drafters.{self.name}")
            option = getattr(module, "VALUE_OPTION", None)
            if option:
                return {"method": self.name, option: self.value}
        raise BenchError(f"method {self.name!r} takes no '={self.value}'")


def parse_methods(text: str) -> list[MethodSpec]:
    """``plain,pld,eagle3=DIR`` -> specs, with ``hf`` first and ``plain`` second always present."""
    from specdec.infer.drafters import available_methods, unknown_method_message

    specs, known = [], set(available_methods()) | {HF}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in known:
            raise BenchError(unknown_method_message(name, sorted(known)))
        if name in (HF, PLAIN) and value:
            raise BenchError(f"method {name!r} takes no '={value}'")
        specs.append(MethodSpec(name, value.strip() or None))
    for base in (PLAIN, HF):  # the baselines every speedup is measured against
        if not any(s.name == base for s in specs):
            specs.insert(0, MethodSpec(base))
    specs.sort(key=lambda s: {HF: 0, PLAIN: 1}.get(s.name, 2))
    counts: dict[str, int] = {}
    for s in specs:
        counts[s.name] = counts.get(s.name, 0) + 1
    for s in specs:  # results key: the name, or name=VALUE when a name repeats
        s.label = s.name if counts[s.name] == 1 else f"{s.name}={s.value}"
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        typed = [s.name if s.value is None else f"{s.name}={s.value}" for s in specs]
        twice = sorted({t for t in typed if typed.count(t) > 1})
        raise BenchError(f"--methods names {', '.join(twice)} more than once")
    return specs


# ---------------------------------------------------------------------------- generators


@dataclass
class Turn:
    token_ids: list[int]
    seconds: float
    step_tokens: list[int]  # tokens added by each decoding step


class EngineGenerator:
    """A specdec method through ``specdec.infer.api.LLM`` (batch 1, greedy)."""

    def __init__(self, target, spec: MethodSpec, max_len: int, device: str, budget=None,
                 drafter_opts: dict | None = None):
        from specdec.infer.api import LLM

        speculative = spec.name != PLAIN  # the baseline keeps no drafter, so nothing to set
        self.budget = budget if speculative else None
        opts = (drafter_opts or {}) if speculative else {}
        try:
            self.llm = LLM(target, max_batch=1, max_len=max_len, device=device, **spec.llm_kwargs(), **opts)
        except (TypeError, ValueError) as err:  # e.g. an --opt this drafter does not take
            raise BenchError(f"method {spec.label!r}: {err}") from err

    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        from specdec.infer.api import SamplingParams

        _sync()
        t0 = time.perf_counter()
        out = self.llm.generate([prompt_ids], SamplingParams(max_tokens=max_new_tokens), budget=self.budget)[0]
        _sync()
        seconds = time.perf_counter() - t0
        return Turn(list(out.token_ids), seconds, [a + 1 for a in out.stats.get("accepted_per_step", [])])


class HFGenerator:
    """Hugging Face ``model.generate()`` on the same target weights (greedy, KV cache)."""

    def __init__(self, target):
        self.model, self.eos = target.model, target.eos_token_ids
        tok = target.tokenizer
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else (self.eos or [0])[0]

    @torch.inference_mode()
    def __call__(self, prompt_ids: list[int], max_new_tokens: int) -> Turn:
        dev = self.model.device
        ids = torch.tensor([prompt_ids], device=dev)
        _sync()
        t0 = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, eos_token_id=self.eos,
                                  pad_token_id=self.pad, temperature=None, top_p=None, top_k=None)
        _sync()
        seconds = time.perf_counter() - t0
        new = out[0, len(prompt_ids):].tolist()
        for i, t in enumerate(new):  # keep the eos, drop anything after it (as the engine does)
            if t in self.eos:
                new = new[:i + 1]
                break
        return Turn(new, seconds, [1] * len(new))


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- one question


@dataclass
class Answer:
    question_id: object
    category: str
    turns: list[Turn] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def seconds(self) -> float:
        return sum(t.seconds for t in self.turns)

    @property
    def speed(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)

    @property
    def step_tokens(self) -> list[int]:
        return [s for t in self.turns for s in t.step_tokens]

    def tokens(self) -> list[list[int]]:
        return [t.token_ids for t in self.turns]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt of the next assistant turn under the target's chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:  # a base model: a plain transcript
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def answer_question(generate, tokenizer, question: dict, max_new_tokens: int) -> Answer:
    """All turns of one question; each turn sees the previous turns' answers."""
    ans = Answer(question["question_id"], str(question.get("category", "default")))
    messages: list[dict] = []
    for turn in question["turns"]:
        messages.append({"role": "user", "content": turn})
        result = generate(encode_chat(tokenizer, messages), max_new_tokens)
        ans.turns.append(result)
        text = tokenizer.decode(result.token_ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": text})
    return ans


def max_context(tokenizer, questions: list[dict], max_new_tokens: int) -> int:
    """KV length that fits the longest conversation: all its user turns with the template,
    plus max_new_tokens per turn and some slack for re-tokenised answers."""
    longest = 0
    for q in questions:
        msgs = []
        for t in q["turns"]:
            msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": ""}]
        longest = max(longest, len(encode_chat(tokenizer, msgs)) + len(q["turns"]) * (max_new_tokens + 32))
    return longest + 64


# ---------------------------------------------------------------------------- the benchmark


def machine_info(device: str) -> dict:
    from specdec.infer.dtypes import native_bf16

    cpu = platform.processor() or platform.machine()
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith(("model name", "cpu family")))
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu = fields.get("model name", cpu)
        if "cpu family" in fields:  # "AMD EPYC" alone names several machine kinds
            cpu += f" (family {fields['cpu family']})"
    except OSError:
        pass
    # the vector ISA and native bf16 decide which kernels run: figures differ by both
    info = {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_native_bf16": native_bf16("cpu"),
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "device": str(device), "python": platform.python_version(),
            "platform": platform.platform()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def run_benchmark(target, methods: list[MethodSpec], questions: list[dict], max_new_tokens: int = 256,
                  runs: int = 1, device: str = "cpu", progress: bool | None = None, budget=None,
                  drafter_opts: dict | None = None) -> dict[str, list[list[Answer]]]:
    """answers[label][run][question] for every method (hf and plain included). ``budget`` (a
    TreeBudget) and ``drafter_opts`` go to every speculative method (None: each drafter's own).

    The methods take turns question by question (the order rotating from one question to the
    next), not one whole pass after another: a shared or throttled machine drifts by 15-20%
    over the minutes a pass takes, and interleaving puts that drift into every method alike
    instead of into their ratios. Each method keeps its own engine (and KV cache) throughout.
    """
    from tqdm.auto import tqdm

    if runs < 1:
        raise BenchError(f"--runs must be >= 1, got {runs}")
    tok = target.tokenizer
    max_len = max_context(tok, questions, max_new_tokens)
    total = len(methods) * (runs * len(questions) + 1)
    bar = tqdm(total=total, desc="specdec-bench", unit="q", disable=None if progress is None else not progress)
    answers: dict[str, list[list[Answer]]] = {s.label: [[] for _ in range(runs)] for s in methods}
    try:
        generators = {}
        for spec in methods:
            bar.set_postfix_str(f"warm-up {spec.label}")
            generate = (HFGenerator(target) if spec.name == HF else
                        EngineGenerator(target, spec, max_len, device, budget, drafter_opts))
            answer_question(generate, tok, questions[0], max_new_tokens)  # warm-up, untimed
            generators[spec.label] = generate
            bar.update(1)
        labels = list(generators)
        for r in range(runs):
            for i, q in enumerate(questions):
                shift = (r * len(questions) + i) % len(labels)
                for label in labels[shift:] + labels[:shift]:
                    bar.set_postfix_str(label)
                    answers[label][r].append(answer_question(generators[label], tok, q, max_new_tokens))
                    bar.update(1)
    finally:
        bar.close()
    return answers


def summarize(answers: list[Answer], plain: list[Answer], hf: list[Answer]) -> dict:
    """Metrics of one method on one run over one set of questions (see the module docstring)."""
    steps = [s for a in answers for s in a.step_tokens]
    speed = float(np.mean([a.speed for a in answers]))
    plain_speed = float(np.mean([a.speed for a in plain]))
    hf_speed = float(np.mean([a.speed for a in hf]))
    same = [a.tokens() == p.tokens() for a, p in zip(answers, plain)]
    return {"tau": float(np.mean(steps)) if steps else 1.0, "tokens_per_s": speed,
            "speedup": speed / plain_speed, "speedup_vs_hf": speed / hf_speed,
            "identical_rate": float(np.mean(same)), "n_questions": len(answers),
            "new_tokens": int(sum(a.new_tokens for a in answers)), "_steps": steps}


def aggregate(per_run: list[dict]) -> dict:
    """Mean over runs (+ ``<metric>_std`` when runs > 1) and the acceptance-length histogram."""
    out = {m: float(np.mean([r[m] for r in per_run])) for m in METRICS}
    out["n_questions"] = per_run[0]["n_questions"]
    tokens = [r["new_tokens"] for r in per_run]
    out["new_tokens"] = tokens[0] if len(tokens) == 1 else float(np.mean(tokens))
    if len(per_run) > 1:
        for m in METRICS + ("new_tokens",):
            out[f"{m}_std"] = float(np.std([r[m] for r in per_run], ddof=1))
    steps = np.array([s for r in per_run for s in r["_steps"]], dtype=np.int64)
    hist = np.bincount(steps, minlength=2).tolist() if steps.size else [0, 0]
    out["accept_length_hist"] = hist  # [k] = steps that added k tokens (summed over runs)
    n = max(int(steps.size), 1)
    # [i] = share of steps whose i+1-th drafted position was accepted (added >= i+2 tokens)
    out["accept_rate_by_position"] = [float((steps >= i + 2).sum() / n) for i in range(max(len(hist) - 2, 0))]
    out["steps"] = int(steps.size)
    return out


def results_for(answers: dict[str, list[list[Answer]]]) -> dict[str, dict]:
    """methods.<label>.overall / .categories.<category>, each from ``aggregate``."""
    runs = len(answers[PLAIN])
    cats = list(dict.fromkeys(a.category for a in answers[PLAIN][0]))
    out = {}
    for label, per_run in answers.items():
        def over(select):
            return aggregate([summarize(*(select(answers[k][r]) for k in (label, PLAIN, HF)))
                              for r in range(runs)])

        out[label] = {"overall": over(lambda xs: xs),
                      "categories": {c: over(lambda xs, c=c: [a for a in xs if a.category == c])
                                     for c in cats}}
    return out
