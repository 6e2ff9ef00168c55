"""Prompt sources: JSONL files and the built-in synthetic verifiable tasks.

A JSONL line is an object with ``prompt`` plus task fields (``answer``, ``tests``,
``task``, ...). The dataset order is a seeded permutation per epoch, and its
position is part of the checkpoint, so a resumed run sees the same prompts.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Prompt:
    text: str
    fields: dict = field(default_factory=dict)
    """Task fields handed to the reward layer (task, answer, tests, ...)."""


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts file not found: {p}")
    out = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(f"{p}:{lineno}: each line must be an object with a string 'prompt'")
            fields = {k: v for k, v in obj.items() if k != "prompt"}
            out.append(Prompt(obj["prompt"], fields))
    if not out:
        raise ValueError(f"{p}: no prompts")
    return out


def synthetic_prompts(task: str, digits: int, count: int, seed: int) -> list[Prompt]:
    """Verifiable tasks whose gold answer is known: ``12+34=`` -> ``46``; ``sort:3,1,2=`` -> ``1,2,3``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if task == "addition":
            a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
            out.append(Prompt(f"{a}+{b}=", {"task": "addition", "answer": str(a + b)}))
        elif task == "sorting":
            xs = [rng.randrange(10) for _ in range(digits)]
            out.append(Prompt("sort:" + ",".join(map(str, xs)) + "=",
                              {"task": "sorting", "answer": ",".join(map(str, sorted(xs)))}))
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
