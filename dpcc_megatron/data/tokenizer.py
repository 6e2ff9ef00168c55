"""Tokenizers: a built-in character tokenizer for the synthetic tasks, or a local HF one.

Both expose the same small interface the trainer uses:

* ``encode_prompt(prompt, chat)``: a prompt (a string or a list of ``{role, content}`` messages)
  to token ids, ready for generation. With ``chat`` the tokenizer's chat template is applied
  with the generation prompt; the template decides about BOS (it usually writes it), so the
  rendered text is encoded without adding special tokens again. A raw string prompt is
  encoded with the tokenizer's own special-token rule (``add_special_tokens=True``: BOS where
  the tokenizer's post-processor adds one, nothing where it does not).
* ``encode_response(prompt, response, chat)``: the gold response's ids as the model should
  produce them after ``encode_prompt`` (the chat template's assistant turn up to and including
  its end-of-turn token, or the text plus EOS).
* ``stop_ids``: every id that ends a response: the tokenizer's EOS, the ``eos_token_id`` list
  of ``generation_config.json`` next to it, and configured extras.
* ``decode(ids)``: the text before the first stop id, special tokens dropped.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
# Everything the synthetic tasks and their prompts can contain.
_CHARS = "0123456789+-*=,.:;()[]{}<>/ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n#_'\"!?"

PromptLike = Union[str, Sequence[dict]]


def _is_messages(prompt) -> bool:
    return not isinstance(prompt, str)


class CharTokenizer:
    """One id per character; ids 0/1/2 are pad/eos/bos. Unknown characters are an error.

    It has no chat template: message-list prompts need an HF tokenizer (``data.tokenizer``).
    """

    has_chat_template = False

    def __init__(self, extra_stop_tokens: Iterable[str] = ()) -> None:
        self.specials = [PAD, EOS, BOS]
        self.itos = self.specials + list(_CHARS)
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.bos_id = 0, 1, 2
        self.stop_ids = frozenset([self.eos_id] + [_single_id(self, t) for t in extra_stop_tokens])

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.stoi.get(token)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the built-in character tokenizer") from None

    def encode_prompt(self, prompt: PromptLike, chat: bool = True) -> list[int]:
        if _is_messages(prompt):
            raise ValueError("a prompt given as chat messages needs a tokenizer with a chat template; the built-in "
                             "character tokenizer has none (set data.tokenizer to a local HF tokenizer directory)")
        return self.encode(prompt)

    def encode_response(self, prompt: PromptLike, response: str, chat: bool = True) -> list[int]:
        return self.encode(response) + [self.eos_id]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i in self.stop_ids:
                break
            if i >= len(self.specials) and i < len(self.itos):
                out.append(self.itos[i])
        return "".join(out)


def _single_id(tok, token: str) -> int:
    i = tok.token_to_id(token)
    if i is None:
        raise ValueError(f"data.stop_tokens: {token!r} is not a single token of the tokenizer")
    return int(i)


def generation_config_eos_ids(path: str | Path) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` in ``path`` (an int or a list), [] when absent."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return []
    try:
        value = json.loads(f.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{f}: not a valid generation config ({e})") from None
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{f}: eos_token_id must be an int or a list of ints, got {value!r}")
    return list(values)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local directory (no hub access)."""

    def __init__(self, path: str, extra_stop_tokens: Iterable[str] = ()) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos_id = self.tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"data.tokenizer: the tokenizer at {path} has no eos_token")
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = self.tok.bos_token_id
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))
        stops = {int(self.eos_id)}
        for i in generation_config_eos_ids(path):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"{Path(path) / 'generation_config.json'}: eos_token_id {i} is outside the "
                                 f"tokenizer's vocabulary [0, {self.vocab_size})")
            stops.add(i)
        stops.update(_single_id(self, t) for t in extra_stop_tokens)
        self.stop_ids = frozenset(stops)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def token_to_id(self, token: str) -> Optional[int]:
        i = self.tok.convert_tokens_to_ids(token)
        if i is None or (i == self.tok.unk_token_id and token != self.tok.unk_token):
            return None
        return int(i)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _render(self, messages, add_generation_prompt: bool) -> str:
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer at {self.path} has no chat template: set data.chat_template: false "
                             "to send string prompts raw, or use a tokenizer with one")
        return self.tok.apply_chat_template(list(messages), tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

    @staticmethod
    def _messages(prompt: PromptLike) -> list[dict]:
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def encode_prompt(self, prompt: PromptLike, chat: bool = True) -> list[int]:
        if chat:
            return self.encode(self._render(self._messages(prompt), True))
        if _is_messages(prompt):
            raise ValueError("a prompt given as chat messages cannot be sent raw: set data.chat_template: true")
        return self.tok.encode(prompt, add_special_tokens=True)

    def encode_response(self, prompt: PromptLike, response: str, chat: bool = True) -> list[int]:
        """The assistant turn as the template writes it, cut after its first stop token; without a
        template (or when the template's rendering does not extend the prompt's), text + EOS."""
        if chat:
            messages = self._messages(prompt)
            head = self.encode_prompt(prompt, chat=True)
            full = self.encode(self._render(messages + [{"role": "assistant", "content": response}], False))
            if full[:len(head)] == head and len(full) > len(head):
                tail = full[len(head):]
                for j, t in enumerate(tail):
                    if t in self.stop_ids:
                        return tail[:j + 1]
                return tail + [self.eos_id]
        return self.encode(response) + [self.eos_id]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        for j, i in enumerate(ids):
            if i in self.stop_ids:
                ids = ids[:j]
                break
        return self.tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str, extra_stop_tokens: Iterable[str] = ()):
    if spec == "char":
        return CharTokenizer(extra_stop_tokens)
    if not Path(spec).is_dir():
        raise ValueError(f"data.tokenizer: {spec!r} is neither 'char' nor a local tokenizer directory")
    return HFTokenizer(spec, extra_stop_tokens)


def resolve_vocab_size(cfg, tokenizer=None):
    """``cfg`` with ``model.vocab_size`` set: the tokenizer's size when it was left out (Megatron pads it
    to make_vocab_size_divisible_by x TP when the model is built). A configured size below the
    tokenizer's is an error: ids of the tokenizer would fall outside the embedding."""
    import dataclasses

    tok = tokenizer if tokenizer is not None else build_tokenizer(cfg.data.tokenizer, cfg.data.stop_tokens)
    size = cfg.model.vocab_size
    if size is None:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size))
    if size < tok.vocab_size:
        raise ValueError(f"model.vocab_size={size} is smaller than the tokenizer's {tok.vocab_size} tokens "
                         f"(data.tokenizer={cfg.data.tokenizer!r}); raise it or leave it out to use the tokenizer's")
    return cfg
