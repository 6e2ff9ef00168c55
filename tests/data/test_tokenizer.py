"""Tokenizers: a real local HF tokenizer with a chat template and several EOS ids (built with the
`tokenizers` library), BOS as the tokenizer says, stop ids, gold responses, vocab size resolution."""
import json

import pytest

from dpcc_megatron.data.tokenizer import CharTokenizer, build_tokenizer, resolve_vocab_size
from dpcc_megatron.testing.hf_tokenizer import build_chat_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp("tok") / "chat")


def test_chat_template_with_generation_prompt_and_bos_from_the_template(tok_dir):
    tok = build_tokenizer(str(tok_dir))
    ids = tok.encode_prompt(MESSAGES)
    text = tok.tok.decode(ids)
    assert text == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert ids.count(tok.bos_id) == 1  # the template writes BOS; it is not added a second time
    # a string prompt becomes one user message
    assert tok.tok.decode(tok.encode_prompt("Hi")) == "<|bos|><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_raw_prompts_follow_the_tokenizers_bos_rule(tok_dir):
    tok = build_tokenizer(str(tok_dir))
    raw = tok.encode_prompt("2+3=", chat=False)
    assert raw[0] == tok.bos_id and tok.tok.decode(raw[1:]) == "2+3="  # its post-processor adds BOS
    with pytest.raises(ValueError, match="data.chat_template: true"):
        tok.encode_prompt(MESSAGES, chat=False)
    char = CharTokenizer()
    assert char.encode_prompt("2+3=") == char.encode("2+3=")  # no template, no BOS: raw
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        char.encode_prompt(MESSAGES)


def test_tokenizer_without_template_refuses_messages(tmp_path):
    tok = build_tokenizer(str(build_chat_tokenizer(tmp_path / "plain", chat_template=False)))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="has no chat template.*data.chat_template: false"):
        tok.encode_prompt(MESSAGES)


def test_stop_ids_are_eos_plus_generation_config_plus_extras(tok_dir, tmp_path):
    tok = build_tokenizer(str(tok_dir))
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>", "<|eot|>", "<|im_start|>")}
    assert tok.eos_id == ids["<|endoftext|>"]
    assert tok.stop_ids == {ids["<|endoftext|>"], ids["<|im_end|>"], ids["<|eot|>"]}
    extra = build_tokenizer(str(tok_dir), extra_stop_tokens=["<|im_start|>"])
    assert extra.stop_ids == tok.stop_ids | {ids["<|im_start|>"]}
    with pytest.raises(ValueError, match=r"data.stop_tokens: 'not one token' is not a single token"):
        build_tokenizer(str(tok_dir), extra_stop_tokens=["not one token"])
    # decode stops at whichever stop id comes first
    body = tok.encode("It is 5")
    assert tok.decode(body + [ids["<|im_end|>"]] + tok.encode(" junk")) == "It is 5"
    assert tok.decode(body + [ids["<|eot|>"], 40]) == "It is 5"
    # a generation_config id outside the vocabulary is refused
    bad = build_chat_tokenizer(tmp_path / "bad")
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 100000]}))
    with pytest.raises(ValueError, match="eos_token_id 100000 is outside"):
        build_tokenizer(str(bad))


def test_gold_response_is_the_templates_assistant_turn(tok_dir):
    tok = build_tokenizer(str(tok_dir))
    r = tok.encode_response(MESSAGES, "5 #### 5")
    assert tok.tok.decode(r) == "5 #### 5<|im_end|>"  # ends at the end-of-turn token, no trailing newline
    raw = tok.encode_response("2+3=", "5", chat=False)
    assert raw == tok.encode("5") + [tok.eos_id]


def test_vocab_size_from_the_tokenizer_or_refused_when_smaller(tok_dir):
    from dpcc_megatron.config import load_config

    cfg = load_config(overrides=[f"data.tokenizer={tok_dir}"])
    assert cfg.model.vocab_size is None
    assert resolve_vocab_size(cfg).model.vocab_size == 270
    assert resolve_vocab_size(load_config(overrides=[f"data.tokenizer={tok_dir}", "model.vocab_size=300"])) \
        .model.vocab_size == 300
    with pytest.raises(ValueError, match=r"model.vocab_size=200 is smaller than the tokenizer's 270 tokens"):
        resolve_vocab_size(load_config(overrides=[f"data.tokenizer={tok_dir}", "model.vocab_size=200"]))
    assert resolve_vocab_size(load_config()).model.vocab_size == CharTokenizer().vocab_size
