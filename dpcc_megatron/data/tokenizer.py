"""Tokenizers: a built-in character tokenizer for the synthetic tasks, or a local HF one."""
from __future__ import annotations

from pathlib import Path

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
# Everything the synthetic tasks and their prompts can contain.
_CHARS = "0123456789+-*=,.:;()[]{}<>/ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n#_'\"!?"


class CharTokenizer:
    """One id per character; ids 0/1/2 are pad/eos/bos. Unknown characters are an error."""

    def __init__(self) -> None:
        self.specials = [PAD, EOS, BOS]
        self.itos = self.specials + list(_CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.bos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the built-in character tokenizer") from None

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i >= len(self.specials) and i < len(self.itos):
                out.append(self.itos[i])
        return "".join(out)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (no hub access)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer at {path} has no eos_token")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str):
    if spec == "char":
        return CharTokenizer()
    if not Path(spec).is_dir():
        raise ValueError(f"data.tokenizer: {spec!r} is neither 'char' nor a local tokenizer directory")
    return HFTokenizer(spec)
