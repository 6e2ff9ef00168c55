"""Dataset adapters: JSONL or Parquet records in the common layouts -> :class:`Prompt`.

``data.format`` picks the adapter (``auto`` chooses one per record):

========  =====================================================================  ==============
format    record                                                                 task
========  =====================================================================  ==============
plain     ``prompt`` (string or chat messages) + the reward layer's task fields   ``task`` field
          (``task``, ``answer``, ``tests``, ``schema``, ``pattern``, ``language``);
          optional gold ``response``
verl      ``prompt`` (chat messages), ``data_source``, ``reward_model.ground_truth``,  from
          optional ``extra_info`` (``answer``: a worked solution)                ``data_source``
gsm8k     ``question``, ``answer`` (worked solution ending ``#### 72``)           math
math      ``problem``, ``solution`` (with ``\\boxed{}``), optional ``answer``     math
code      ``prompt``/``question``/``text``, tests in ``tests``/``test``/``test_list``  code
          (HumanEval's ``entry_point`` adds ``check(entry_point)``), optional
          ``canonical_solution``/``solution``/``code`` as gold
========  =====================================================================  ==============

A record the chosen format cannot read raises :class:`DataError` naming the file and line
(Parquet: row). A record without a task is an error unless ``data.default_task`` is set:
nothing falls back to another task's reward silently. ``Prompt.gold`` is the gold response
where the layout has one (supervised warm-start); it is None otherwise.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from .prompts import Prompt

FORMATS = ("auto", "plain", "verl", "gsm8k", "math", "code")
TASK_FIELDS = ("task", "answer", "tests", "schema", "pattern", "language")

_MATH_SOURCES = ("gsm8k", "math", "aime", "amc", "numina", "deepscaler", "dapo", "olympiad", "minerva")
_CODE_SOURCES = ("code", "apps", "taco", "leetcode", "humaneval", "mbpp", "livecodebench", "primeintellect")


class DataError(ValueError):
    """A prompt file or one of its records cannot be read; the message names file and line."""


# -- records --------------------------------------------------------------------------------------
def read_records(path: str | Path, key: str = "data.prompts") -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every record of a ``.jsonl`` (blank lines skipped) or ``.parquet`` file."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{key}: file not found: {p}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{p}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{key}: reading Parquet ({p}) needs pyarrow: pip install 'dpcc-megatron[parquet]'") \
                from None
        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{p}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{p}:row {i}", row
    else:
        raise DataError(f"{key}: {p} must be a .jsonl or .parquet file")


# -- helpers --------------------------------------------------------------------------------------
def _text(record: dict, where: str, *names: str, required: bool = True) -> Optional[str]:
    for name in names:
        value = record.get(name)
        if isinstance(value, str) and value.strip():
            return value
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    if required:
        raise DataError(f"{where}: needs a non-empty string field {' or '.join(repr(n) for n in names)}")
    return None


def _answer(value: Any, where: str, name: str) -> Optional[str]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {name!r} must be a string or number, got {type(value).__name__}")
    return str(value)


def _prompt(value: Any, where: str, name: str = "prompt"):
    """A string, or a list of {role, content} messages (validated)."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field {name!r} is empty")
        return value
    if isinstance(value, (list, tuple)) and value:
        out = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: {name}[{i}] must be an object with string 'role' and 'content'")
            out.append({"role": m["role"], "content": m["content"]})
        if out[-1]["role"] != "user":
            raise DataError(f"{where}: the last message of {name!r} must have role 'user', got {out[-1]['role']!r}")
        return out
    raise DataError(f"{where}: field {name!r} must be a string or a non-empty list of chat messages, "
                    f"got {type(value).__name__}")


def _make(prompt, fields: dict, gold: Optional[str], where: str, default_task: Optional[str]) -> Prompt:
    task = fields.get("task") or default_task
    if not task:
        raise DataError(f"{where}: the record has no task type; add a 'task' field or set data.default_task")
    if not isinstance(task, str):
        raise DataError(f"{where}: field 'task' must be a string, got {type(task).__name__}")
    fields = {**fields, "task": task}
    if isinstance(prompt, str):
        return Prompt(prompt, fields, gold=gold, source=where)
    return Prompt(prompt[-1]["content"], fields, messages=prompt, gold=gold, source=where)


def _boxed(text: str) -> Optional[str]:
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    depth = 0
    for j in range(i, len(text)) if i >= 0 else ():
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip() or None
    return None


# -- adapters -------------------------------------------------------------------------------------
def plain(r: dict, where: str, default_task: Optional[str]) -> Prompt:
    prompt = _prompt(r.get("prompt"), where)
    fields = {k: v for k, v in r.items() if k not in ("prompt", "response")}
    if "answer" in fields:
        fields["answer"] = _answer(fields["answer"], where, "answer")
    gold = _text(r, where, "response", required=False) or fields.get("answer")
    return _make(prompt, fields, gold, where, default_task)


def task_from_data_source(source: str) -> Optional[str]:
    s = source.lower()
    if any(k in s for k in _CODE_SOURCES):
        return "code"
    if any(k in s for k in _MATH_SOURCES):
        return "math"
    return None


def verl(r: dict, where: str, default_task: Optional[str]) -> Prompt:
    prompt = _prompt(r.get("prompt"), where)
    rm = r.get("reward_model")
    if not isinstance(rm, dict) or "ground_truth" not in rm:
        raise DataError(f"{where}: verl format needs 'reward_model' with a 'ground_truth'")
    extra = r.get("extra_info") if isinstance(r.get("extra_info"), dict) else {}
    source = r.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(f"{where}: field 'data_source' must be a string")
    task = r.get("task") or extra.get("task") or (task_from_data_source(source) if source else None)
    if not task and not default_task:
        raise DataError(f"{where}: cannot tell the task from data_source {source!r}; add a 'task' field or set "
                        "data.default_task")
    fields: dict = {"task": task or default_task, "data_source": source}
    truth = rm["ground_truth"]
    if fields["task"] == "code":
        tests = truth if isinstance(truth, str) else None
        if tests is None:
            raise DataError(f"{where}: code ground_truth must be a string of test code")
        fields["tests"] = tests
    else:
        fields["answer"] = _answer(truth, where, "reward_model.ground_truth")
    gold = extra.get("answer") if isinstance(extra.get("answer"), str) else None
    return _make(prompt, fields, gold, where, default_task)


def gsm8k(r: dict, where: str, default_task: Optional[str]) -> Prompt:
    question = _text(r, where, "question")
    solution = _text(r, where, "answer")
    if "####" not in solution:
        raise DataError(f"{where}: GSM8K 'answer' must end with '#### <number>'")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise DataError(f"{where}: nothing after '####' in 'answer'")
    return _make(question, {"task": r.get("task") or "math", "answer": final}, solution, where, default_task)


def math(r: dict, where: str, default_task: Optional[str]) -> Prompt:
    problem = _text(r, where, "problem")
    solution = _text(r, where, "solution", required=False)
    final = _answer(r.get("answer"), where, "answer") or (_boxed(solution) if solution else None)
    if not final:
        raise DataError(f"{where}: MATH format needs an 'answer' or a 'solution' with \\boxed{{...}}")
    return _make(problem, {"task": r.get("task") or "math", "answer": final}, solution, where, default_task)


def code(r: dict, where: str, default_task: Optional[str]) -> Prompt:
    prompt = r.get("prompt")
    prompt = _prompt(prompt, where) if prompt is not None else _text(r, where, "question", "text", "problem")
    tests = r.get("tests", r.get("test", r.get("test_list")))
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests)
    if not isinstance(tests, str) or not tests.strip():
        raise DataError(f"{where}: code format needs tests as a string or list of strings in 'tests', 'test' "
                        "or 'test_list'")
    entry = r.get("entry_point")
    if isinstance(entry, str) and re.search(r"^def check\(", tests, re.MULTILINE):
        tests = f"{tests}\n\ncheck({entry})\n"
    gold = _text(r, where, "solution", "code", required=False)
    canonical = _text(r, where, "canonical_solution", required=False)
    if canonical is not None:
        gold = (prompt + canonical) if isinstance(prompt, str) and entry else canonical
    return _make(prompt, {"task": r.get("task") or "code", "tests": tests}, gold, where, default_task)


ADAPTERS: dict[str, Callable[[dict, str, Optional[str]], Prompt]] = {
    "plain": plain, "verl": verl, "gsm8k": gsm8k, "math": math, "code": code}


def detect_format(r: dict) -> Optional[str]:
    """The layout of one record, or None when it matches none."""
    if "reward_model" in r or "data_source" in r:
        return "verl"
    if "prompt" in r and not any(k in r for k in ("test", "test_list", "canonical_solution")):
        return "plain"
    if any(k in r for k in ("tests", "test", "test_list")):
        return "code"
    if "question" in r and isinstance(r.get("answer"), str) and "####" in r["answer"]:
        return "gsm8k"
    if "problem" in r and ("solution" in r or "answer" in r):
        return "math"
    return None


def load_prompts(path: str | Path, fmt: str = "auto", default_task: Optional[str] = None,
                 key: str = "data.prompts") -> list[Prompt]:
    """Every record of ``path`` through the ``fmt`` adapter; errors name file and line."""
    if fmt not in FORMATS:
        raise DataError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    out = []
    for where, record in read_records(path, key):
        if not isinstance(record, dict):
            raise DataError(f"{where}: each record must be an object, got {type(record).__name__}")
        name = fmt if fmt != "auto" else detect_format(record)
        if name is None:
            raise DataError(f"{where}: cannot tell the layout of this record (keys: {', '.join(sorted(record))}); "
                            f"set data.format to one of {', '.join(FORMATS[1:])}")
        out.append(ADAPTERS[name](record, where, default_task))
    if not out:
        raise DataError(f"{key}: {path} holds no records")
    return out


def check_tasks(prompts: list[Prompt], known: set[str], fallback: Optional[str]) -> None:
    """Every prompt's task must have reward checkers (unless ``reward.fallback_task`` is set)."""
    if fallback:
        return
    for p in prompts:
        task = p.fields.get("task")
        if task not in known:
            raise DataError(f"{p.source or 'prompt'}: task {task!r} has no reward checkers (tasks: "
                            f"{', '.join(sorted(known))}); configure it under reward.tasks, fix the record, "
                            "or set reward.fallback_task")
