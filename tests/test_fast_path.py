"""The CPU fast path end to end: chosen by default where the CPU has bf16 instructions, close
to the float32 reference, weights kept packed, and every token independent of what shares
its step (batching, prefix-cache hits, chunked prefill all give the same tokens)."""

from __future__ import annotations

import pytest
import torch

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.compute_plan import cpu_fast_path_isa
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.kernels import cpu_ext

pytestmark = pytest.mark.skipif(
    not (cpu_fast_path_isa() is not None and cpu_ext.load()),
    reason="the fast path needs AVX-512 and the C++ kernels",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is the largest planet in the solar system?\nA:",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read books "
    "about distant stars, strange machines and the people who built them. One day",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_default_is_the_fast_path_and_float32_is_the_reference(default_llm, default_llm_f32):
    plan = core_of(default_llm).plan
    assert plan.fused_cpu and plan.kv_cache_dtype == torch.bfloat16
    assert "CPU fast path" in plan.describe()
    reference = core_of(default_llm_f32).plan
    assert not reference.fused_cpu and reference.dtype == torch.float32


def test_engine_thread_keeps_torch_ops_off_openmp_and_the_pool_at_torch_threads(
    default_llm, default_llm_f32
):
    """The engine's thread runs torch's ops on itself alone (an OpenMP worker spinning
    after them took a quarter of a core from the kernels' pool), while the pool's loops
    keep torch's thread count; the caller's thread keeps its own setting. The float32
    path's steps are torch's ops and keep their threads."""
    ops = torch.ops.pagedllm
    callers = torch.get_num_threads()
    default_llm.generate(["Hello"], GREEDY)
    on_engine = default_llm.engine.call(lambda: (torch.get_num_threads(), ops.pool_threads()))
    assert on_engine == (1, callers)
    assert (torch.get_num_threads(), ops.pool_threads()) == (callers, callers)
    assert default_llm_f32.engine.call(torch.get_num_threads) == callers


def test_gguf_weights_stay_packed(default_llm):
    """SmolLM2's Q4_1 linears and Q8_0 embedding are held packed: ~100 MB, not the 540 MB of
    float32 (or 270 MB of bf16) a dequantized copy would take; in the kernels' tile layout,
    with no row-major copy left."""
    from pagedllm_integrations.quant.packed import TiledWeight
    from pagedllm_integrations.quant.packed_linear import PackedStackedLinear

    model = core_of(default_llm).model
    linears = [m for m in model.modules() if isinstance(m, PackedStackedLinear)]
    assert linears and all(isinstance(w, TiledWeight) for m in linears for w in m.segments)
    assert {w.kind for m in linears for w in m.segments} == {"u4"}
    assert all(w.scales.dtype == torch.float16 for m in linears for w in m.segments)  # Q4_1
    table = model.embed_tokens.fast_weight
    assert isinstance(table, TiledWeight) and table.kind == "i8"  # Q8_0, tied to the head
    held = sum(m.weight_bytes() for m in linears) + table.nbytes
    assert held < 110 * 2**20, held
    float_tensors = [p for p in model.parameters() if p.dtype == torch.float32]
    assert sum(p.numel() for p in float_tensors) < 100_000  # the norms only


def test_tokens_do_not_depend_on_batching_caching_or_chunking(default_llm):
    batched = tokens(default_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for prompt, expected in zip(PROMPTS, batched):
        assert tokens(default_llm.generate(prompt, GREEDY, use_tqdm=False)) == [expected]
    # The same prompts again: their full blocks now come from the prefix cache.
    again = default_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any(o.num_cached_tokens > 0 for o in again)
    assert tokens(again) == batched
    # Prompts split into 16-token chunks, in steps shared with other sequences' decodes.
    with LLM(max_num_batched_tokens=16, max_model_len=512, disable_log_stats=True) as chunked:
        assert tokens(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == batched


def test_fast_path_logits_are_close_to_float32(default_llm, default_llm_f32):
    """Same weights (exact packed values), int8 activations in blocks of 32 (llama.cpp's
    own Q8 activations): the first token's log-probabilities agree with float32's to ~0.10
    on average (0.32 at most on these prompts; blocks of 16 gave 0.06 and 0.21 at half the
    batch speed; the perplexity cost is in BENCHMARKS.md)."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    fast = default_llm.generate(PROMPTS, params, use_tqdm=False)
    reference = default_llm_f32.generate(PROMPTS, params, use_tqdm=False)
    differences = []
    for f, r in zip(fast, reference):
        # the first generated token comes from the same prompt: compare its distribution
        f_top, r_top = f.outputs[0].logprobs[0], r.outputs[0].logprobs[0]
        assert f.outputs[0].token_ids[0] == r.outputs[0].token_ids[0]
        shared = set(f_top) & set(r_top)
        assert len(shared) >= 3  # a flat prompt's 5th and 6th candidates are 0.1 apart
        differences += [abs(f_top[t].logprob - r_top[t].logprob) for t in shared]
    assert max(differences) < 0.4
    assert sum(differences) / len(differences) < 0.15


def test_dense_checkpoint_runs_in_bf16_close_to_float32(tiny_llama_dir):
    """A float safetensors folder on the fast path holds bf16 weights."""
    from pagedllm_integrations.quant.packed_linear import PackedStackedLinear

    with LLM(str(tiny_llama_dir), disable_log_stats=True) as fast:
        linear = next(
            m for m in core_of(fast).model.modules() if isinstance(m, PackedStackedLinear)
        )
        assert [w.dtype for w in linear.segments] == [torch.bfloat16]
        got = tokens(fast.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(str(tiny_llama_dir), dtype="float32", disable_log_stats=True) as reference:
        want = tokens(reference.generate(PROMPTS, GREEDY, use_tqdm=False))
    # Random weights drawn wide (clear margins): the first tokens agree.
    assert [t[:4] for t in got] == [t[:4] for t in want]


def test_awq_checkpoint_repacks_exactly_into_the_fast_path(tiny_llama_factory, tmp_path):
    """AWQ's (q - z) * s becomes the packed U4 format's s * q + m with the same values, and
    the fast path's next-token distribution follows the float32 path's."""
    from pagedllm_integrations.cli_quantize import load_float_model
    from pagedllm_integrations.quant.awq_format import AWQConfig, dequantize
    from pagedllm_integrations.quant.awq_linear import AWQLinear
    from pagedllm_integrations.quant.quantizer import rtn_quantize_model, save_awq_checkpoint

    src = tiny_llama_factory("fast-awq", hidden_size=128, num_heads=4, num_kv_heads=2, shards=1)
    model, tokenizer = load_float_model(src)
    quantized = rtn_quantize_model(model, group_size=64)
    folder = save_awq_checkpoint(
        model, quantized, tmp_path / "awq", AWQConfig(group_size=64), src, tokenizer
    )
    first = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    with LLM(str(folder), dtype="float32", disable_log_stats=True) as reference:
        want = reference.generate(PROMPTS, first, use_tqdm=False)
        ref_layer = core_of(reference).model.layers[0].self_attn.qkv_proj
        dense = dequantize(
            ref_layer.qweight, ref_layer.qzeros, ref_layer.scales, 64, torch.float32
        ).t()
    with LLM(str(folder), disable_log_stats=True) as fast:
        layer = core_of(fast).model.layers[0].self_attn.qkv_proj
        assert isinstance(layer, AWQLinear) and layer._packed is not None
        assert torch.equal(layer._packed.dequantize(), dense)  # exact repacking
        got = fast.generate(PROMPTS, first, use_tqdm=False)
    # A random model's distribution is flat (top log-probs near -4), so compare it rather
    # than long greedy paths, which flip on near-ties. The int8 activations (blocks of 32)
    # move them by 0.21 at most here.
    for f, r in zip(got, want):
        f_top, r_top = f.outputs[0].logprobs[0], r.outputs[0].logprobs[0]
        for token in set(f_top) & set(r_top):
            assert abs(f_top[token].logprob - r_top[token].logprob) < 0.3
