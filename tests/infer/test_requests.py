"""Incremental detokenization: the streamed text equals a decode of the whole output, step by step."""
from __future__ import annotations

import random

import pytest

from specdec.infer.requests import IncrementalText
from specdec.infer.tiny import tiny_tokenizer


def grow_and_compare(tokenizer, ids: list[int], rng: random.Random) -> int:
    """Feed ids in random chunks of 1-4; -> how many updates were checked."""
    text, out, checked = IncrementalText(tokenizer), [], 0
    while len(out) < len(ids):
        out += ids[len(out):len(out) + rng.randint(1, 4)]
        assert text.update(out) == tokenizer.decode(out, skip_special_tokens=True), out
        checked += 1
    return checked


def test_byte_level_text_matches_a_full_decode_through_split_characters():
    """Every UTF-8 byte is a token here: accents, CJK and emoji arrive a byte at a time (the
    pending \ufffd tail), special tokens are skipped."""
    tok = tiny_tokenizer()
    rng = random.Random(0)
    text = "Héllo wörld, naïve café; 日本語 🙂👍🏽<|im_end|>\n\tdef f(x): return x ** 2"
    base = tok(text, add_special_tokens=False)["input_ids"]
    assert len(base) > len(text)  # multi-byte characters really span several tokens
    checked = 0
    for trial in range(60):
        ids = base[:rng.randint(1, len(base))] + [rng.randrange(len(tok)) for _ in range(rng.randint(0, 20))]
        checked += grow_and_compare(tok, ids, rng)
    assert checked > 300


def test_a_decoder_that_drops_a_leading_space_gets_its_context():
    """SentencePiece-style decoding drops the first word's leading space: a window decoded
    without the tokens before it would glue words together."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    words = ["▁the", "▁cat", "▁sat", "s", "▁on", "▁mat", ".", "▁ü", "<unk>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert fast.decode([1]) == "cat" and fast.decode([0, 1]) == "the cat"
    rng = random.Random(1)
    for _ in range(40):
        grow_and_compare(fast, [rng.randrange(len(words) - 1) for _ in range(rng.randint(1, 30))], rng)


class RewritingTokenizer:
    """A decoder whose later tokens change earlier text (token 0 upper-cases what came before)."""

    def decode(self, ids, skip_special_tokens=True):
        text = ""
        for i in ids:
            text = text.upper() if i == 0 else text + "abc"[i - 1]
        return text


@pytest.mark.parametrize("seed", range(3))
def test_a_decoder_that_rewrites_earlier_text_falls_back_to_a_full_decode(seed):
    rng = random.Random(seed)
    grow_and_compare(RewritingTokenizer(), [rng.randrange(4) for _ in range(60)], rng)
