"""Tiny randomly initialised Llama-shaped targets for tests and tiny recipes.

Built from a config in code (no network): a byte-level tokenizer (256 bytes +
ChatML specials) and a LlamaForCausalLM with a few small layers. The recipes in
``recipes/tiny/`` name it as ``target: tiny-llama``.
"""
from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is a token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
        unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int = 320, **overrides):
    from transformers import LlamaConfig

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def build_tiny_target(folder: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a random tiny Llama + byte tokenizer to ``folder`` (a normal HF folder)."""
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    tok = tiny_tokenizer()
    cfg = tiny_llama_config(**config_overrides)
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    cfg.pad_token_id = tok.convert_tokens_to_ids("<|pad|>")
    cfg.bos_token_id = None
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Random init with std 0.02 gives near-uniform logits; a larger scale makes the
    # tiny target opinionated enough that greedy paths and acceptance are non-trivial.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder
