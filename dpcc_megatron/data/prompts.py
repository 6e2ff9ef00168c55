"""Prompts, the built-in synthetic verifiable tasks, and the resumable prompt stream.

Files (JSONL, Parquet) in the common layouts are read by :mod:`dpcc_megatron.data.formats`.
The dataset order is a seeded permutation per epoch, and its position is part of the
checkpoint, so a resumed run sees the same prompts.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Prompt:
    text: str
    """The prompt string (for chat prompts: the last user message, what the reward layer sees)."""
    fields: dict = field(default_factory=dict)
    """Task fields handed to the reward layer (task, answer, tests, ...)."""
    messages: Optional[list] = None
    """Chat messages ``[{role, content}, ...]`` when the record gave the prompt as a conversation."""
    gold: Optional[str] = None
    """A gold response (supervised warm-start), where the data has one."""
    source: str = ""
    """Where it came from (``file:line``), for error messages."""

    @property
    def chat_input(self):
        """What the tokenizer encodes: the messages, or the string."""
        return self.messages if self.messages is not None else self.text


def synthetic_prompts(task: str, digits: int, count: int, seed: int) -> list[Prompt]:
    """Verifiable tasks whose gold answer is known: ``12+34=`` -> ``46``; ``sort:3,1,2=`` -> ``1,2,3``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if task == "addition":
            a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
            out.append(Prompt(f"{a}+{b}=", {"task": "addition", "answer": str(a + b)}, gold=str(a + b)))
        elif task == "sorting":
            xs = [rng.randrange(10) for _ in range(digits)]
            answer = ",".join(map(str, sorted(xs)))
            out.append(Prompt("sort:" + ",".join(map(str, xs)) + "=", {"task": "sorting", "answer": answer},
                              gold=answer))
        else:
            raise ValueError(f"data.synthetic_task: unknown task {task!r}")
    return out


class PromptDataset:
    """Endless, seeded, resumable stream of prompts."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True) -> None:
        self.prompts = prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.pos = 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.pos >= len(self._order):
                self.epoch += 1
                self.pos = 0
                self._order = self._make_order()
            out.append(self.prompts[self._order[self.pos]])
            self.pos += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
