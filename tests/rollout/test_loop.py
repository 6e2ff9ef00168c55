"""The decode loop with a toy recurrent model: caching, batching, EOS, log-probs, bad input."""
import pytest
import torch

from dpcc_megatron.rollout import LocalChannel, NonFiniteLogitsError, decode, process_logits

VOCAB, HIDDEN, EOS, PAD = 23, 8, 1, 0


class ToyLM:
    """h_t = tanh(h_{t-1} A + E[x_t]); logits = h_t W. float64 so cached and uncached runs agree to ~1e-15."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
        self.A = torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64) / HIDDEN ** 0.5
        self.W = 3 * torch.randn(HIDDEN, VOCAB, generator=g, dtype=torch.float64)
        self.W[:, EOS] = 0.0
        self.bias = torch.zeros(VOCAB, dtype=torch.float64)
        self.bias[EOS] = 8.0  # EOS competes with the top tokens, so responses vary in length

    def run(self, h, cols):
        for t in range(cols.shape[1]):
            h = torch.tanh(h @ self.A + self.emb[cols[:, t]])
        return h

    def logits(self, h):
        return h @ self.W + self.bias

    def full_logits(self, tokens):
        """[N, L, V] next-token logits at every position (the 'trainer's forward')."""
        h = torch.zeros(tokens.shape[0], HIDDEN, dtype=torch.float64)
        out = []
        for t in range(tokens.shape[1]):
            h = self.run(h, tokens[:, t:t + 1])
            out.append(self.logits(h))
        return torch.stack(out, 1)


class Cached:
    def __init__(self, lm, batch, log):
        self.lm, self.h, self.log = lm, torch.zeros(batch, HIDDEN, dtype=torch.float64), log

    def forward(self, prefix, start):
        self.log.append((prefix.shape[0], prefix.shape[1] - start))
        h = self.lm.run(self.h[:prefix.shape[0]], prefix[:, start:])
        self.h[:prefix.shape[0]] = h
        return self.lm.logits(h).float()

    def reorder(self, order):
        self.h[:len(order)] = self.h[order].clone()


class Uncached(Cached):
    def forward(self, prefix, start):
        h = self.lm.run(torch.zeros(prefix.shape[0], HIDDEN, dtype=torch.float64), prefix)
        return self.lm.logits(h).float()

    def reorder(self, order):
        pass


PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3, 4], [15, 16, 17, 18], [19]]


def run(prompts=PROMPTS, kind=Cached, lm=None, log=None, **kw):
    lm = lm or ToyLM()
    log = [] if log is None else log
    args = dict(max_new_tokens=6, eos_id=EOS, pad_id=PAD, vocab_size=VOCAB, temperature=1.0,
                generator=torch.Generator().manual_seed(0))
    args.update(kw)
    return decode(lambda b, w: kind(lm, b, log), LocalChannel(), prompts, **args)


def test_cached_equals_recompute():
    for batch_size in (None, 2):
        for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.8)):
            ref = run(kind=Uncached, batch_size=batch_size, **kw)
            got = run(kind=Cached, batch_size=batch_size, **kw)
            assert torch.equal(got.tokens, ref.tokens), kw
            torch.testing.assert_close(got.sampler_logprobs, ref.sampler_logprobs)
            torch.testing.assert_close(got.policy_logprobs, ref.policy_logprobs)


def test_greedy_does_not_depend_on_batching():
    ref = run(temperature=0.0)
    assert torch.equal(run(temperature=0.0, batch_size=2).tokens, ref.tokens)
    assert torch.equal(run(temperature=0.0, batch_size=1).tokens, ref.tokens)


def test_greedy_batched_equals_one_prompt_at_a_time():
    batched = run(temperature=0.0, max_new_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        alone = run([prompt], temperature=0.0, max_new_tokens=8)
        assert batched.responses()[i] == alone.responses()[0]


def test_layout_masks_and_eos_stopping():
    r = run(temperature=1.5, max_new_tokens=12, generator=torch.Generator().manual_seed(1))
    assert r.tokens.shape[1] == int((r.prompt_lens + r.response_lens).max())
    assert r.stopped_by_eos.any() and not r.stopped_by_eos.all()  # the seed exercises both endings
    for i, prompt in enumerate(PROMPTS):
        p, n = len(prompt), int(r.response_lens[i])
        assert r.tokens[i, :p].tolist() == prompt and int(r.prompt_lens[i]) == p
        assert 1 <= n <= 12
        assert r.response_mask[i].tolist() == [0.0] * p + [1.0] * n + [0.0] * (r.tokens.shape[1] - p - n)
        assert (r.tokens[i, p + n:] == PAD).all()
        response = r.responses()[i]
        assert EOS not in response[:-1], "generation continued past EOS"
        assert bool(r.stopped_by_eos[i]) == (response[-1] == EOS)
        if response[-1] != EOS:
            assert n == 12
        assert (r.sampler_logprobs[i][r.response_mask[i] == 0] == 0).all()
        assert (r.sampler_logprobs[i][r.response_mask[i] == 1] < 0).all()


def test_finished_rows_leave_the_batch():
    log = []
    r = run(temperature=1.5, max_new_tokens=12, generator=torch.Generator().manual_seed(1), log=log)
    assert log[0] == (len(PROMPTS), 1)  # prefill covers the shortest prompt
    batch_sizes = [b for b, _ in log]
    assert min(batch_sizes) < len(PROMPTS), "finished rows were never dropped"
    assert all(s == 1 for _, s in log[1:])
    assert batch_sizes == sorted(batch_sizes, reverse=True)
    assert len(log) == int((r.prompt_lens + r.response_lens).max()) - 1


def test_logprobs_match_a_full_forward_of_the_generated_sequences():
    lm = ToyLM()
    r = run(lm=lm, temperature=0.7, top_k=6, top_p=0.9, max_new_tokens=8)
    full = lm.full_logits(r.tokens).float()[:, :-1]  # logits at t-1 predict token t
    target = r.tokens[:, 1:]
    mask = r.response_mask[:, 1:].bool()
    policy = torch.log_softmax(full, -1).gather(-1, target[..., None])[..., 0]
    sampler = torch.log_softmax(process_logits(full, 0.7, 6, 0.9), -1).gather(-1, target[..., None])[..., 0]
    torch.testing.assert_close(r.policy_logprobs[:, 1:][mask], policy[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(r.sampler_logprobs[:, 1:][mask], sampler[mask], atol=1e-5, rtol=0)
    assert not torch.allclose(sampler[mask], policy[mask], atol=1e-3)  # the filters changed the distribution


def test_same_seed_same_rollout_other_seed_differs():
    a = run(generator=torch.Generator().manual_seed(7))
    b = run(generator=torch.Generator().manual_seed(7))
    c = run(generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def test_non_finite_logits_raise():
    class Poisoned(Cached):
        def forward(self, prefix, start):
            out = super().forward(prefix, start)
            if prefix.shape[1] >= 3:
                out[0, 4] = float("nan")
            return out

    with pytest.raises(NonFiniteLogitsError, match="column 3"):
        run(kind=Poisoned)


@pytest.mark.parametrize("prompts,kw,match", [
    ([], {}, "at least one prompt"),
    ([[1, 2], []], {}, r"prompts\[1\] is empty"),
    ([[1, VOCAB]], {}, rf"prompts\[0\] holds token id {VOCAB}"),
    ([[1, -1]], {}, r"prompts\[0\] holds token id -1"),
    ([[1]], dict(max_new_tokens=0), "max_new_tokens"),
    ([[1]], dict(pad_id=VOCAB), "pad_id"),
    ([[1]], dict(eos_id=-3), "eos_id"),
    ([[1]], dict(generator=None), "Generator"),
    ([[1]], dict(top_p=0.0), "top_p"),
])
def test_bad_input_is_a_clear_error(prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        run(prompts, **kw)


def test_any_of_several_stop_ids_ends_a_row():
    """An instruct model's end-of-turn token ends a response as EOS does (a set of stop ids)."""
    single = run(temperature=1.5, max_new_tokens=12, generator=torch.Generator().manual_seed(1))
    # A second stop id: the most frequent non-EOS response token of the single-EOS run.
    counts = torch.bincount(torch.tensor([t for r in single.responses() for t in r if t != EOS]), minlength=VOCAB)
    other = int(counts.argmax())
    both = run(temperature=1.5, max_new_tokens=12, generator=torch.Generator().manual_seed(1), eos_id={EOS, other})
    assert both.response_lens.sum() < single.response_lens.sum()
    for i, response in enumerate(both.responses()):
        assert not ({EOS, other} & set(response[:-1])), "generation continued past a stop id"
        assert bool(both.stopped_by_eos[i]) == (response[-1] in (EOS, other))
    assert any(r[-1] == other for r in both.responses())
    greedy, greedy_both = run(temperature=0.0, max_new_tokens=12), run(temperature=0.0, max_new_tokens=12,
                                                                        eos_id=[EOS, other])
    for a, b in zip(greedy.responses(), greedy_both.responses()):  # same tokens up to the first stop id
        cut = next((j + 1 for j, t in enumerate(a) if t in (EOS, other)), len(a))
        assert b == a[:cut]
    assert run(eos_id=None, max_new_tokens=5).response_lens.tolist() == [5] * len(PROMPTS)
    with pytest.raises(ValueError, match="eos_id 99"):
        run(eos_id=[EOS, 99])
