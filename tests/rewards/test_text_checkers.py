import pytest

from dpcc_megatron.rewards import get_checker
from dpcc_megatron.rewards.checkers.penalties import overlong_penalty

from .conftest import S

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


def test_json_validity_and_schema(ctx):
    js = get_checker("json")
    assert js(S('{"name": "Ada", "age": 36}'), ctx) == 1.0
    assert js(S('Here you go:\n```json\n{"name": "Ada", "age": 36}\n```'), ctx) == 1.0
    assert js(S('{"name": "Ada", "age": 36'), ctx) == 0.0  # truncated
    assert js(S("{'name': 'Ada'}"), ctx) == 0.0  # Python dict, not JSON
    assert js(S('{"name": "Ada", "age": 36}', schema=SCHEMA), ctx) == 1.0
    assert js(S('{"name": "Ada", "age": -1}', schema=SCHEMA), ctx) == 0.5  # valid JSON, violates the schema
    assert js(S('{"name": "Ada"}', schema=SCHEMA), ctx, partial=False) == 0.0
    assert js(S('{"name": "Ada"}'), ctx, schema=SCHEMA) == 0.5  # schema from the checker params
    assert js(S('prefix {"name": "Ada", "age": 1} suffix'), ctx, strict=True) == 0.0
    assert js(S('prefix {"name": "Ada", "age": 1} suffix'), ctx) == 1.0


def test_json_broken_schema_raises_so_it_is_counted(ctx):
    with pytest.raises(Exception):
        get_checker("json")(S("{}", schema={"type": "no-such-type"}), ctx)


def test_format_regex_and_template(ctx):
    fmt = get_checker("format")
    assert fmt(S("<think>a</think> 42"), ctx, template="<think>{}</think>{}") == 1.0
    assert fmt(S("42 <think>a</think>"), ctx, template="<think>{}</think>{}") == 0.0
    assert fmt(S(" 46 "), ctx, pattern=r"\s*-?\d+\s*", fullmatch=True) == 1.0
    assert fmt(S("46 apples"), ctx, pattern=r"\s*-?\d+\s*", fullmatch=True) == 0.0
    assert fmt(S("46 apples"), ctx, pattern=r"\d+") == 1.0
    assert fmt(S("anything"), ctx) is None  # no pattern: does not apply
    assert fmt(S("ok", pattern="^no"), ctx, pattern="ok") == 0.0  # the sample's own pattern wins


def test_language_consistency(ctx):
    lang = get_checker("language")
    en = "Photosynthesis is the process by which plants convert light into chemical energy."
    zh = "光合作用是植物利用光能把二氧化碳和水转化为有机物的过程。"
    garbage = "Photosynthesis 是 the 过程 by which 植物 convert 光 into 能量 and 水 the"
    assert lang(S(en, prompt="Explain photosynthesis."), ctx) == 1.0
    assert lang(S(zh, prompt="解释光合作用。"), ctx) == 1.0
    assert lang(S(garbage, prompt="Explain photosynthesis."), ctx) < 0.3
    assert lang(S(garbage, prompt="解释光合作用。"), ctx) < 0.3
    assert lang(S(zh, prompt="Explain photosynthesis."), ctx) == 0.0  # wrong language entirely
    assert lang(S(zh, prompt="Explain photosynthesis.", language="zh"), ctx) == 1.0  # explicit expectation
    # code, LaTeX and URLs do not count as English inside a Chinese answer
    assert lang(S("答案是 $\\frac{1}{2}$，代码 `print(x)` 见 https://example.com", prompt="问题"), ctx) == 1.0
    assert lang(S("12345"), ctx) is None
    with pytest.raises(ValueError):
        lang(S("hello", language="klingon"), ctx)


def test_overlong_penalty_is_dapo_linear():
    assert overlong_penalty(10, 0, 0) == 0.0  # disabled
    assert overlong_penalty(60, 100, 40) == 0.0
    assert overlong_penalty(80, 100, 40) == pytest.approx(0.5)
    assert overlong_penalty(100, 100, 40) == 1.0
    assert overlong_penalty(150, 100, 40) == 1.0


def test_overlong_and_repetition_checkers(ctx):
    over = get_checker("overlong")
    assert over(S("x", response_ids=list(range(90))), ctx, max_length=100, buffer=20) == pytest.approx(0.5)
    assert over(S("a b c"), ctx, max_length=100, buffer=20) == 0.0
    assert over(S("a b c"), ctx) is None
    rep = get_checker("repetition")
    fresh = "the quick brown fox jumps over the lazy dog while the cat sleeps"
    loop = " ".join(["I think so"] * 20)
    assert rep(S(fresh), ctx) == 0.0
    assert rep(S(loop), ctx) > 0.9
    assert rep(S("x", response_ids=[1, 2, 3, 4] * 10), ctx) > 0.8  # ids win over text


def test_exact_and_sequence(ctx):
    exact = get_checker("exact")
    assert exact(S("  Paris. ", answer="paris"), ctx) == 1.0
    assert exact(S("Paris", answer="paris"), ctx, case_sensitive=True) == 0.0
    assert exact(S("thinking...\n#### Paris", answer="Paris"), ctx) == 1.0
    assert exact(S("Lyon", answer="Paris"), ctx) == 0.0
    seq = get_checker("sequence")
    assert seq(S("1 2 3 5", answer="1 2 3 5"), ctx) == 1.0
    assert seq(S("1, 2, 3, 5", answer="1 2 3 5"), ctx) == 1.0
    assert seq(S("sorted: 1 2 3 5", answer="1 2 3 5"), ctx) == 1.0
    assert seq(S("1 3 2 5", answer="1 2 3 5"), ctx) == 0.0
    assert seq(S("1 3 2 5", answer="1 2 3 5"), ctx, partial=True) == 0.5
    assert seq(S("-3 0 7", answer="-3 0 7"), ctx) == 1.0
    assert seq(S("apple banana", answer="apple banana cherry"), ctx) == 0.0
    assert seq(S("5 3", answer=None), ctx) is None
