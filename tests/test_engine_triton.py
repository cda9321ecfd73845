"""The engine on the Triton kernels gives the torch path's greedy tokens.

Without CUDA the kernels run through Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), so the model is tiny: hidden 64, 4 query heads, 2 KV heads, head dim
16 (the kernels pad the head dim to at least 16 for tl.dot).
"""

from __future__ import annotations

import pytest

from pagedllm_integrations import LLM, SamplingParams

pytestmark = pytest.mark.triton

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read",
    "def fibonacci(n):",
]
MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny_gqa_folder(tiny_llama_factory):
    return tiny_llama_factory(
        "tiny-triton", hidden_size=64, num_heads=4, num_kv_heads=2, num_layers=2, shards=1
    )


def greedy_tokens(folder, backend: str, **engine_args) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(
        str(folder),
        device="cpu",
        attention_backend=backend,
        disable_log_stats=True,
        num_kv_blocks=64,
        max_model_len=256,
        **engine_args,
    ) as llm:
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        # Again: the prompts now hit the prefix cache, so prefill runs over a cached context.
        again = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in first]
    assert [o.outputs[0].token_ids for o in again] == tokens
    return tokens


def test_triton_backend_matches_torch_greedy(tiny_gqa_folder):
    # A small token budget chunks the long prompt: mixed batches of a prefill chunk after
    # cached tokens and decodes of the other requests, in one launch.
    args = dict(max_num_batched_tokens=12, block_size=8)
    want = greedy_tokens(tiny_gqa_folder, "torch", **args)
    got = greedy_tokens(tiny_gqa_folder, "triton", **args)
    assert all(len(t) == MAX_NEW for t in want)
    assert got == want
