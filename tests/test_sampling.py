"""Sampling parameters: checked against transformers where it has the same feature, and
against hand-computed distributions where it does not."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.detokenizer import IncrementalDetokenizer
from pagedllm_integrations.engine.request import Request
from pagedllm_integrations.engine.sampler import Sampler

CHAT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def fake_request(params: SamplingParams, outputs=(), prompt=(1,), seed=None) -> Request:
    request = Request("r", list(prompt), params)
    for t in outputs:
        request.append_output_token(t)
    if seed is not None:
        request.generator = torch.Generator().manual_seed(seed)
    return request


def draw(logits: list[float], params: SamplingParams, times: int = 4000) -> Counter:
    sampler = Sampler(len(logits), torch.device("cpu"), seed=0)
    rows = torch.tensor([logits] * times)
    requests = [fake_request(params) for _ in range(times)]
    return Counter(sampler(rows, requests).token_ids)


@pytest.fixture(params=["torch", "kernels"])
def sampling_path(request, monkeypatch):
    """Rows with only a temperature are drawn by the C++ kernel where it is loaded
    (`sample_rows`), else by torch: each test using this runs on both."""
    from pagedllm_integrations.engine import sampler as sampler_module
    from pagedllm_integrations.kernels import cpu_ext

    if request.param == "kernels":
        if not cpu_ext.load():
            pytest.skip(f"no C++ CPU kernels here: {cpu_ext.load_error()}")
    else:
        monkeypatch.setattr(sampler_module, "_cpu_kernels", lambda: False)
    return request.param


def test_temperature_sampling_follows_the_softmax(sampling_path):
    logits = [2.0, 1.0, 0.0, -1.0]
    counts = draw(logits, SamplingParams(temperature=1.0))
    probs = torch.softmax(torch.tensor(logits), 0).tolist()
    for token, p in enumerate(probs):
        assert abs(counts[token] / 4000 - p) < 0.03


def test_temperature_draws_are_the_inverse_cdf_of_the_softmax(sampling_path):
    """Each row's token is where its cumulative softmax (float64 here) crosses the row's
    uniform, up to float32 rounding; masked (-inf) tokens are never drawn, and a seeded
    row draws the same token alone and in a batch."""
    g = torch.Generator().manual_seed(3)
    vocab = 1000  # not a multiple of 16: a partial last group
    logits = torch.randn(24, vocab, generator=g) * 3
    logits[::3, 500:] = float("-inf")  # every third row: the upper half masked
    temperatures = [0.3, 0.7, 1.0, 1.5]
    params = [SamplingParams(temperature=temperatures[i % 4]) for i in range(24)]
    requests = [fake_request(p, seed=100 + i) for i, p in enumerate(params)]
    tokens = Sampler(vocab, torch.device("cpu"))(logits.clone(), requests).token_ids
    for i, token in enumerate(tokens):
        u = torch.rand(1, generator=torch.Generator().manual_seed(100 + i)).double().item()
        probs = torch.softmax(logits[i].double() / temperatures[i % 4], 0)
        cdf = probs.cumsum(0)
        assert probs[token] > 0
        assert cdf[token] >= u - 1e-5 and (token == 0 or cdf[token - 1] <= u + 1e-5)
    alone = [
        Sampler(vocab, torch.device("cpu"))(
            logits[i : i + 1].clone(), [fake_request(params[i], seed=100 + i)]
        ).token_ids[0]
        for i in range(24)
    ]
    assert alone == tokens


def test_top_k_top_p_min_p_cut_the_distribution():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert set(draw(logits, SamplingParams(top_k=2))) == {0, 1}
    counts = draw(logits, SamplingParams(top_k=2))
    assert abs(counts[0] / 4000 - 0.5 / 0.8) < 0.03
    assert set(draw(logits, SamplingParams(top_p=0.7))) == {0, 1}  # 0.5 + 0.3 covers 0.7
    assert set(draw(logits, SamplingParams(top_p=0.85))) == {0, 1, 2}
    assert set(draw(logits, SamplingParams(min_p=0.25))) == {0, 1, 2}  # >= 0.125
    assert set(draw(logits, SamplingParams(min_p=0.5))) == {0, 1}


def test_penalties_follow_the_openai_formulas():
    sampler = Sampler(4, torch.device("cpu"))
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    params = SamplingParams(
        temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    request = fake_request(params, outputs=[1, 1, 2], prompt=[3])
    sampler._apply_penalties(logits, [request])
    # token 1: 2/2 - 0.25*2 - 0.5; token 2: -1*2 - 0.25 - 0.5; token 3 (prompt): 0.5/2.
    expected = torch.tensor([[1.0, 2.0 / 2 - 0.5 - 0.5, -2.0 - 0.25 - 0.5, 0.25]])
    torch.testing.assert_close(logits, expected)


def test_repetition_penalty_matches_transformers(default_llm, hf_default_model):
    model, tokenizer = hf_default_model
    prompt = "List the days of the week: Monday, Tuesday,"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        hf = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            pad_token_id=tokenizer.eos_token_id,
        )[0, ids.shape[1] :].tolist()
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)
    ours = default_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert ours == hf[: len(ours)]


def test_logprobs_match_transformers(default_llm_f32, hf_default_model):
    model, tokenizer = hf_default_model
    prompt = "The three primary colours are"
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    out = default_llm_f32.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    prompt_ids = tokenizer(prompt).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(prompt_ids) - 1 : -1]
    total = 0.0
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert abs(entry[token].logprob - reference[position, token].item()) < 1e-3
        top3 = reference[position].topk(3).indices.tolist()
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)][:3] == top3
        total += entry[token].logprob
    assert abs(out.cumulative_logprob - total) < 1e-4


def test_same_seed_same_output_whatever_shares_the_batch(default_llm):
    # ignore_eos: this prompt ends at once with p = 0.22, and two seeds that both end there
    # would be equal outputs; 16 sampled tokens from two seeds are not.
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = default_llm.generate("Write a short poem.", seeded, use_tqdm=False)[0]
    noisy = SamplingParams(temperature=1.0, max_tokens=16)
    batch = default_llm.generate(
        ["Other request one", "Write a short poem.", "Other request two"],
        [noisy, seeded, noisy],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = default_llm.generate("Write a short poem.", seeded.clone(seed=99), use_tqdm=False)[
        0
    ]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_stop_strings_are_cut_across_token_boundaries(default_llm):
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = "Once upon a time"
    full = default_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    tokenizer = default_llm.get_tokenizer()
    # A stop string made of the end of one token and the start of the next.
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    boundary = len(pieces[3])
    stop = full.text[boundary - 2 : boundary + 2]
    assert len(stop) == 4 and full.text.find(stop) == boundary - 2
    cut = default_llm.generate(prompt, params.clone(stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[: boundary - 2]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = default_llm.generate(
        prompt, params.clone(stop=[stop], include_stop_str_in_output=True), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: boundary + 2]


def test_stop_token_ids_eos_ignore_eos_and_min_tokens(default_llm):
    tokenizer = default_llm.get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer(CHAT, add_special_tokens=False).input_ids}
    base = SamplingParams(temperature=0, max_tokens=60)
    natural = default_llm.generate(prompt, base, use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == tokenizer.eos_token_id
    stop_id = natural.token_ids[1]
    by_id = default_llm.generate(prompt, base.clone(stop_token_ids=[stop_id]), use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == natural.token_ids[:2]
    assert by_id[0].outputs[0].stop_reason == stop_id
    n = len(natural.token_ids)
    longer = default_llm.generate(prompt, base.clone(min_tokens=n + 5), use_tqdm=False)
    assert len(longer[0].outputs[0].token_ids) >= n + 5
    ignoring = default_llm.generate(
        prompt, base.clone(ignore_eos=True, max_tokens=n + 3), use_tqdm=False
    )[0].outputs[0]
    assert len(ignoring.token_ids) == n + 3 and ignoring.finish_reason == "length"


def test_skip_special_tokens_false_keeps_them_in_the_text(default_llm):
    tokenizer = default_llm.get_tokenizer()
    prompt = {"prompt_token_ids": tokenizer(CHAT, add_special_tokens=False).input_ids}
    params = SamplingParams(temperature=0, max_tokens=60, skip_special_tokens=False)
    out = default_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert out.text.endswith("<|im_end|>")


@pytest.mark.parametrize("text", ["naïve café ☕ 世界 🙂🚲 done", "ünïcödé ✓ 日本語のテキスト"])
def test_incremental_detokenization_never_shows_half_a_character(default_llm, text):
    tokenizer = default_llm.get_tokenizer()
    ids = tokenizer(text, add_special_tokens=False).input_ids
    # Multi-byte characters are split across byte-level tokens in this vocabulary.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1, 2, 3])
    for token in ids:
        detok.add_token(token)
        assert "\ufffd" not in detok.output_text
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids)


def test_top_k_top_p_on_the_top_candidates_equals_a_full_sort():
    """The nucleus is found among each row's largest probabilities (widening as needed), and
    keeps exactly what sorting the whole vocabulary keeps, with the same renormalisation."""
    from pagedllm_integrations.engine.sampler import _top_k_top_p

    def full_sort(probs, top_k, top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = torch.arange(probs.shape[1])[None, :] < top_k[:, None]
        sorted_probs = sorted_probs * keep
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        keep &= sorted_probs.cumsum(dim=-1) - sorted_probs < top_p[:, None]
        keep[:, 0] = True
        return torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)

    vocab = 5000
    generator = torch.Generator().manual_seed(0)
    for spread in (0.2, 1.0, 8.0):  # flat (wide nuclei: the width must grow) to peaked
        probs = torch.softmax(torch.randn(8, vocab, generator=generator) * spread, -1)
        top_k = torch.tensor([vocab, 20, vocab, 1, 1000, vocab, 50, vocab])
        top_p = torch.tensor([0.9, 1.0, 0.5, 0.9, 0.95, 1.0, 0.8, 0.999])
        ours, reference = _top_k_top_p(probs, top_k, top_p), full_sort(probs, top_k, top_p)
        assert torch.equal(ours > 0, reference > 0), spread
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-7)
