"""Judges of the advanced track: a real-valued utility per sample.

The contrastive layer turns utilities into Bradley-Terry win probabilities,
``P(i beats j) = sigmoid((u_i - u_j) / T)``, so a judge only has to rank. A
judge is any object with ``utilities(samples, base) -> 1-D float64 tensor``
(``base``: the samples' base-track scores). Two are built in:

* :class:`DeterministicJudge` (default): base score plus quality features
  (no repeated n-grams, language consistency, brevity).
* :class:`HFRewardModelJudge`: a local HF sequence-classification reward
  model, scored in batches; transformers is imported only when it is built.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .checkers.language import language_share
from .sample import Sample
from .text import repeated_ngram_share, response_tokens


class Judge(Protocol):
    def utilities(self, samples: Sequence[Sample], base: Sequence[float]) -> torch.Tensor: ...


class DeterministicJudge:
    """u = base_coef*base + repetition_coef*(1 - repeated share) + language_coef*lang + length_coef*brevity."""

    def __init__(self, base_coef: float = 4.0, repetition_coef: float = 1.0, language_coef: float = 1.0,
                 length_coef: float = 0.5, length_scale: int = 512, ngram: int = 4):
        self.coef = (base_coef, repetition_coef, language_coef, length_coef)
        self.length_scale = length_scale
        self.ngram = ngram

    def features(self, sample: Sample) -> tuple[float, float, float]:
        tokens = response_tokens(sample.response, sample.response_ids)
        fresh = 1.0 - repeated_ngram_share(tokens, self.ngram) if self.ngram > 0 else 1.0
        try:
            share = language_share(sample.response, sample.prompt, sample.language)
        except ValueError:  # unknown language code: the language checker reports it; stay neutral here
            share = None
        brevity = 1.0 - min(1.0, len(tokens) / self.length_scale)
        return fresh, 1.0 if share is None else share, brevity

    def utilities(self, samples: Sequence[Sample], base: Sequence[float]) -> torch.Tensor:
        cb, cr, cl, cn = self.coef
        out = []
        for sample, b in zip(samples, base):
            fresh, lang, brevity = self.features(sample)
            out.append(cb * b + cr * fresh + cl * lang + cn * brevity)
        return torch.tensor(out, dtype=torch.float64)


class HFRewardModelJudge:
    """Utility = reward-model logit of (prompt, response); loaded from a local directory only.

    One output label: that logit. Two or more: logit of the last label minus the first
    (the usual "good" vs "bad" head). Inputs use the tokenizer's chat template when it
    has one, else ``prompt + "\\n" + response``; too-long inputs keep their end.
    """

    def __init__(self, path: str, batch_size: int = 8, max_tokens: int = 1024, device: str = "cpu"):
        from pathlib import Path

        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"reward.judge.path: reward model directory not found: {path}")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True)
        if self.model.config.pad_token_id is None:  # needed to find each row's last real token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        self.device, self.batch_size, self.max_tokens = device, batch_size, max_tokens

    def _text(self, sample: Sample) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": sample.response}],
                tokenize=False)
        return f"{sample.prompt}\n{sample.response}"

    @torch.no_grad()
    def utilities(self, samples: Sequence[Sample], base: Sequence[float]) -> torch.Tensor:
        out = []
        for i in range(0, len(samples), self.batch_size):
            texts = [self._text(s) for s in samples[i:i + self.batch_size]]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                                 max_length=self.max_tokens).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits.float()
            out.append(logits[:, 0] if logits.shape[-1] == 1 else logits[:, -1] - logits[:, 0])
        if not out:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(out).to("cpu", torch.float64)


def build_judge(cfg) -> Judge:
    """Judge from a :class:`~dpcc_megatron.config.reward.RewardConfig`."""
    j = cfg.judge
    if j.kind == "hf_rm":
        return HFRewardModelJudge(j.path, batch_size=j.batch_size, max_tokens=j.max_tokens, device=j.device)
    return DeterministicJudge(j.base_coef, j.repetition_coef, j.language_coef, j.length_coef, j.length_scale,
                              ngram=cfg.penalties.repetition_ngram)
