"""Build the bundled `tasks` prompt set (train/assets/task_mix.jsonl) from the bundled texts.

Why: a draft head generalises poorly to task types it never saw. Trained on GSM8K and chat
prompts only, the EAGLE-3 head accepted 0.57 of first drafts on math word problems but
0.12-0.18 on summarisation, extraction, translation and coding (Spec-Bench first turns,
measured 2026-11-30). These prompts ask the target for those kinds of replies (summaries,
extractions, answers from a passage, translations, rewrites, programs, role play) about
permissively licensed text we already ship: OpenAssistant-derived guanaco conversations
(Apache-2.0) and GSM8K *train* questions (MIT). The target then writes the replies itself
(self-distillation), so no reply text comes from anywhere else.

Deterministic (seeded); families are interleaved so that the first N prompts are a balanced
mix. Rerun after changing a template:

    python scripts/make_task_prompts.py            # writes train/assets/task_mix.jsonl
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "train" / "assets"
SKIP_FIRST = 300   # the recipes self-distil the first 300 of each bundled file: use other texts
MAX_PASSAGE = 1600  # characters (~400 tokens): prompt + a 256-token reply fit the recipes' 768

LANG_WORDS = {  # a crude language guess for the translation prompts
    "Spanish": {"el", "la", "que", "de", "y", "es", "cómo", "qué", "los", "por", "una", "para"},
    "German": {"der", "die", "und", "ist", "das", "ich", "nicht", "wie", "ein", "zu", "mit"},
    "French": {"le", "les", "et", "est", "je", "pas", "une", "des", "vous", "pour", "dans"},
    "Portuguese": {"não", "uma", "com", "você", "os", "em", "do", "da", "é", "para"},
    "English": {"the", "and", "is", "what", "how", "of", "to", "you", "are", "can"},
}
ROLES = ["a patient primary-school teacher", "a pirate captain", "a nineteenth-century novelist",
         "a sports commentator", "a friendly tour guide", "a grumpy detective", "a startup founder",
         "a medieval knight", "a science-fiction robot", "a motivational coach"]


def language(text: str) -> str | None:
    words = set(re.findall(r"[a-záéíóúñäöüßàèçãõê]+", text.lower()))
    scores = {lang: len(words & vocab) for lang, vocab in LANG_WORDS.items()}
    best = max(scores, key=scores.get)
    return best if scores[best] >= 3 else None


def passage(text: str) -> str:
    """The text cut at a paragraph or sentence end within MAX_PASSAGE characters."""
    if len(text) <= MAX_PASSAGE:
        return text.strip()
    cut = text[:MAX_PASSAGE]
    end = max(cut.rfind("\n\n"), cut.rfind(". "))
    return cut[:end + 1].strip() if end > MAX_PASSAGE // 2 else cut.strip()


def first_sentences(text: str, n: int = 2) -> str:
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return " ".join(parts[:n])


def guanaco_pairs():
    for line in (ASSETS / "guanaco_1k.jsonl").read_text(encoding="utf-8").splitlines()[SKIP_FIRST:]:
        msgs = json.loads(line)["messages"]
        user = next((m["content"] for m in msgs if m["role"] == "user"), None)
        reply = next((m["content"] for m in msgs if m["role"] == "assistant"), None)
        if user and reply:
            yield user.strip(), reply.strip()


def gsm8k_questions():
    for line in (ASSETS / "gsm8k_train.jsonl").read_text(encoding="utf-8").splitlines()[SKIP_FIRST:]:
        yield json.loads(line)["question"].strip()


def families(rng: random.Random) -> dict[str, list[str]]:
    pairs = list(guanaco_pairs())
    rng.shuffle(pairs)
    english = [(q, r) for q, r in pairs if language(r) == "English"]
    long_en = [(q, r) for q, r in english if len(r) > 700]
    foreign = [(q, language(q)) for q, _ in pairs if language(q) not in (None, "English")]
    questions = list(gsm8k_questions())
    rng.shuffle(questions)
    fam: dict[str, list[str]] = {k: [] for k in (
        "summarize", "extract", "rag", "translate_to_en", "translate_from_en", "coding",
        "rewrite", "roleplay", "explain")}
    for q, r in long_en:
        fam["summarize"].append(f"Summarize: {passage(r)}")
        fam["extract"].append(rng.choice([
            "Extract the main points of the following text as a numbered list.\n\n{p}",
            "Read the text below and list every name, number and technical term it mentions, "
            "in JSON with the keys \"names\", \"numbers\" and \"terms\".\n\n{p}",
            "Rate how clear the following explanation is on a scale of 1 to 5 and justify the "
            "rating point by point.\n\n{p}"]).format(p=passage(r)))
        fam["rag"].append(f"{passage(r)}\n\nUsing only the passage above, answer this question: {q}")
        fam["rewrite"].append(rng.choice([
            "Rewrite the following text in a more formal tone:\n\n{p}",
            "Edit the following text to make it shorter and clearer, keeping every fact:\n\n{p}",
            "Turn the following text into an engaging blog post with a title:\n\n{p}"]).format(
            p=passage(r)))
    for q, lang in foreign:
        fam["translate_to_en"].append(f"Translate {lang} to English: {passage(q)}")
    for _, r in english:
        target = rng.choice(["German", "French", "Spanish"])
        fam["translate_from_en"].append(f"Translate English to {target}: {first_sentences(r)}")
    for question in questions:
        fam["coding"].append(rng.choice([
            "Write a Python program that solves this problem and prints the answer:\n{q}",
            "Write a Python function, with a docstring and a short test, that computes the "
            "answer to this problem:\n{q}",
            "Write a JavaScript function that solves this word problem and explain each step:\n{q}"]
        ).format(q=question))
    for q, _ in english:
        if len(q) < 400:
            fam["roleplay"].append(f"Pretend to be {rng.choice(ROLES)} in the following "
                                   f"conversation and stay in character. {q}")
            fam["explain"].append(f"{q} Explain your reasoning step by step.")
    for items in fam.values():  # families built from one passage must not share it side by side
        rng.shuffle(items)
    return fam


def interleave(fam: dict[str, list[str]], count: int) -> list[tuple[str, str]]:
    out, i = [], 0
    while len(out) < count and any(i < len(v) for v in fam.values()):
        for name, items in fam.items():
            if i < len(items) and len(out) < count:
                out.append((name, items[i]))
        i += 1
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ASSETS / "task_mix.jsonl"))
    args = ap.parse_args(argv)
    prompts = interleave(families(random.Random(args.seed)), args.count)
    with open(args.out, "w", encoding="utf-8") as f:
        for i, (name, text) in enumerate(prompts):
            record = {"id": f"tasks-{i:04d}-{name}", "messages": [{"role": "user", "content": text}]}
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    counts: dict[str, int] = {}
    for name, _ in prompts:
        counts[name] = counts.get(name, 0) + 1
    print(f"wrote {len(prompts)} prompts to {args.out}: {counts}")


if __name__ == "__main__":
    main()
