"""The optional HF reward-model judge, with tiny random models and a tokenizer built offline."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpcc_megatron.config.reward import JudgeConfig, RewardConfig
from dpcc_megatron.rewards import DualTrackReward, HFRewardModelJudge, Sample

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = "the answer is 46 47 45 i think maybe so sum of 12 and 34 = + hello world".split()
PROMPT = "12 + 34 ="
RESPONSES = ["46", "the answer is 46", "i think 47", "maybe 45 maybe so", "hello world the sum of 12 and 34 is 46",
             "46 46 46"]


def _tokenizer(path: Path):
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]"] + WORDS)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                              eos_token="[EOS]")
    hf.save_pretrained(path)
    return len(vocab)


@pytest.fixture(scope="module")
def llama_rm(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_rm")
    vocab = _tokenizer(path)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(path)
    return path


def _samples(responses=RESPONSES):
    return [Sample(prompt=PROMPT, response=r, task="addition", answer="46") for r in responses]


def test_rm_utilities_match_unbatched_forward_and_ignore_padding(llama_rm):
    judge = HFRewardModelJudge(str(llama_rm), batch_size=4)
    samples = _samples()
    u = judge.utilities(samples, [0.0] * len(samples))
    assert u.shape == (len(samples),) and u.dtype == torch.float64 and torch.isfinite(u).all()
    assert u.unique().numel() > 1  # a random model still tells the texts apart
    one_by_one = HFRewardModelJudge(str(llama_rm), batch_size=1).utilities(samples, [0.0] * len(samples))
    assert torch.allclose(u, one_by_one, atol=1e-5)  # right padding does not change a row's score
    # independent reference: the model's own logit on each unpadded text
    tok = transformers.AutoTokenizer.from_pretrained(llama_rm)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(llama_rm).eval()
    with torch.no_grad():
        ref = [model(**tok(f"{PROMPT}\n{r}", return_tensors="pt")).logits[0, 0].item() for r in RESPONSES]
    assert torch.allclose(u, torch.tensor(ref, dtype=torch.float64), atol=1e-5)


def test_rm_judge_in_the_dual_track_reward(llama_rm):
    cfg = RewardConfig(judge=JudgeConfig(kind="hf_rm", path=str(llama_rm), batch_size=2))
    with DualTrackReward(cfg) as reward:
        res = reward.score(_samples())
        u = reward.judge.utilities(_samples(), [0.0] * len(RESPONSES))
        perm = [3, 0, 5, 1, 4, 2]
        res_perm = reward.score(_samples([RESPONSES[i] for i in perm]))
    assert ((res.advanced >= 0) & (res.advanced <= 1)).all()
    assert torch.allclose(res_perm.advanced, res.advanced[perm], atol=1e-6)
    # the win rate within the group orders the samples exactly as the reward model does
    assert torch.equal(res.advanced.argsort(), u.argsort())


def test_two_label_gpt2_head_and_missing_dir(tmp_path):
    vocab = _tokenizer(tmp_path)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2, n_positions=64, num_labels=2,
                                  pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(cfg)
    model.save_pretrained(tmp_path)
    judge = HFRewardModelJudge(str(tmp_path))
    u = judge.utilities(_samples(RESPONSES[:2]), [0.0, 0.0])
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = model.eval()(**tok(f"{PROMPT}\n{RESPONSES[0]}", return_tensors="pt")).logits[0]
    assert u[0].item() == pytest.approx((logits[1] - logits[0]).item(), abs=1e-5)
    with pytest.raises(FileNotFoundError, match="reward model directory not found"):
        HFRewardModelJudge(str(tmp_path / "nope"))


def test_default_reward_imports_neither_transformers_nor_megatron():
    code = ("import sys\nfrom dpcc_megatron.rewards import DualTrackReward, Sample\n"
            "r = DualTrackReward(); r.score([Sample(prompt='1+1=', response='2', task='addition', answer='2')])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
