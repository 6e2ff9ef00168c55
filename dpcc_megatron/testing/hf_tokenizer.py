"""A small, real Hugging Face tokenizer built locally with the `tokenizers` library (no hub).

Byte-level BPE (any text encodes), a ChatML chat template that writes the BOS token, a
post-processor that adds BOS to raw prompts, and an instruct-model stop setup: the tokenizer's
EOS is ``<|endoftext|>`` while the end of an assistant turn is ``<|im_end|>``, which only
``generation_config.json``'s ``eos_token_id`` list names (as Qwen2.5-Instruct and Llama-3-Instruct
ship them).

    path = build_chat_tokenizer(tmp_path / "tok")
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eot|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A few merges so that the tokenizer is a real BPE (digits and common pairs).
_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("#", "#"), ("##", "##"), ("1", "0")]


def build_chat_tokenizer(path: str | Path, *, chat_template: bool = True, extra_eot: bool = True) -> Path:
    """Write the tokenizer to ``path`` and return it. ``extra_eot`` also lists ``<|eot|>`` as a stop id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab.setdefault(ch, len(vocab))
    for a, b in _MERGES:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", vocab["<|bos|>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    eos = [vocab["<|im_end|>"], vocab["<|endoftext|>"]] + ([vocab["<|eot|>"]] if extra_eot else [])
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": vocab["<|bos|>"],
                                                             "eos_token_id": eos}))
    return path
