"""Sliding-window layers free what left their window (engine/kv_layout.py,
engine/kv_cache_manager.py): the layout, the manager's tables and prefix hits, and end to
end the same greedy tokens as the one-table layout with fewer blocks held."""

from __future__ import annotations

import pytest
from family_checkpoints import make_family_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm_integrations.engine.kv_layout import (
    first_kept_entry,
    plain_layout,
    windowed_layout,
)
from pagedllm_integrations.engine.request import Request
from pagedllm_integrations.engine.sampling_params import SamplingParams as EngineParams
from pagedllm_integrations.engine.white_box import core_of

SLIDING, FULL = 16, None
# Prompt lookup that drafts from a single matching token: drafts kept and rejected.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, EngineParams(max_tokens=64))


# ------------------------------------------------------------------------------ the layout
def test_gemma3_270m_layers_share_three_tensor_pairs_in_six_tables():
    windows = [FULL if (layer + 1) % 6 == 0 else 512 for layer in range(18)]
    layout = windowed_layout(windows)
    assert layout.num_slots == 3 and layout.group_windows == (None, 512, 512, 512, 512, 512)
    # The table in engine/kv_layout.py's docstring.
    assert layout.layer_groups == (1, 1, 1, 2, 2, 0, 2, 3, 3, 3, 4, 0, 4, 4, 5, 5, 5, 0)
    assert layout.layer_slots == (0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1, 1, 2, 0, 1, 2, 2)
    # No two layers of one group share a tensor pair.
    pairs = list(zip(layout.layer_groups, layout.layer_slots))
    assert len(set(pairs)) == len(pairs)
    # 32k tokens, 512-token steps: 2,048 + 5 x 65 blocks of 3 layers (18 layers: 2,048).
    assert layout.sequence_blocks(32768, 16, 512) == 2048 + 5 * 65
    assert plain_layout(18).sequence_blocks(32768, 16, 512) == 2048


def test_models_without_full_layers_or_without_windows():
    assert windowed_layout([None, None]) == plain_layout(2)
    mistral = windowed_layout([4096] * 4)  # every layer sliding: one windowed table
    assert mistral.group_windows == (4096,) and mistral.num_slots == 4
    # Any length fits in the window's blocks.
    assert mistral.max_sequence_tokens(mistral.sequence_blocks(10**6, 16, 512), 16, 512) > 10**9
    mixed = windowed_layout([8, None, 32, 8, None])  # two windows never share a table
    assert sorted(w for w in mixed.group_windows if w) == [8, 32]
    two_windows = windowed_layout([8, 32, 8, 32])  # no full layer: a table per window
    assert two_windows.group_windows == (8, 32) and two_windows.num_slots == 2


@settings(max_examples=50, deadline=None)
@given(blocks=st.integers(1, 4000), step=st.sampled_from([16, 64, 512]))
def test_max_sequence_tokens_is_the_inverse_of_sequence_blocks(blocks, step):
    layout = windowed_layout([FULL if (layer + 1) % 6 == 0 else 512 for layer in range(18)])
    tokens = layout.max_sequence_tokens(blocks, 16, step)
    assert layout.sequence_blocks(tokens, 16, step) <= blocks
    assert layout.sequence_blocks(tokens + 16, 16, step) > blocks


# ----------------------------------------------------------------------------- the manager
def test_a_sliding_table_keeps_only_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(FULL, 8))
    request = make_request("a", list(range(40)))
    assert kv.allocate_slots(request, 40)
    request.num_computed_tokens = 40
    for token in range(40, 80):  # decode: one token a step
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1)
        full, sliding = kv.req_blocks["a"]
        first = first_kept_entry(8, request.num_computed_tokens, 4)
        assert all(block is not None for block in full)
        assert all(block is None for block in sliding[:first])
        assert all(block is not None for block in sliding[first:])
        assert len(sliding) - first <= cdiv(8, 4) + 1
        request.num_computed_tokens += 1
        kv.pool.check_consistency()
    # The last step (token 79): keys from 72 on, entries 18 and 19 of the sliding table.
    assert kv.num_blocks_of("a") == cdiv(80, 4) + 2
    kv.free(request)
    assert kv.pool.num_free_blocks == 64


def test_a_prefix_hit_reaches_only_as_far_as_every_window_has_its_blocks():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(FULL, 8))
    prompt = list(range(100, 140))  # 10 blocks
    first = make_request("a", prompt)
    assert kv.allocate_slots(first, 20)  # two chunks: the second frees the window's past
    first.num_computed_tokens = 20
    assert kv.allocate_slots(first, 20)
    first.num_computed_tokens = 40
    kv.free(first)  # every block stays cached in the free queue
    again = make_request("b", [*prompt, 7])
    hits, tokens = kv.get_computed_blocks(again)
    assert tokens == 40
    assert all(block is not None for block in hits[0])
    kept = first_kept_entry(8, 40, 4)
    assert hits[1][:kept] == [None] * kept and None not in hits[1][kept:]
    # Lose the sliding table's last block: the hit stops before it, where the window's
    # blocks (entries 7 and 8 for a hit of 9 blocks: keys from position 36 - 8 + 1 on)
    # are still there.
    sliding_last = hits[1][9]
    assert sliding_last is not None
    kv.pool.uncache(sliding_last)
    hits, tokens = kv.get_computed_blocks(again)
    assert tokens == 36 and len(hits[1]) == 9 and None not in hits[1][7:]
    # And without entry 7 either, it stops at 7 blocks (entries 5 and 6 are there).
    entry_7 = hits[1][7]
    assert entry_7 is not None
    kv.pool.uncache(entry_7)
    hits, tokens = kv.get_computed_blocks(again)
    assert tokens == 28 and None not in hits[1][5:]
    assert kv.allocate_slots(again, len(again.all_token_ids) - tokens, hits)
    kv.free(again)
    kv.pool.check_consistency()
    assert kv.pool.num_free_blocks == 64


def test_swap_out_and_in_name_the_same_entries():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(FULL, 8, 8))
    request = make_request("a", list(range(30)))
    assert kv.allocate_slots(request, 16)
    request.num_computed_tokens = 16
    assert kv.allocate_slots(request, 14)
    request.num_computed_tokens = 30
    kv.trim_to_window(request)  # what _preempt does before it copies
    out = kv.held_block_ids("a", 30)
    kv.free(request)
    assert kv.allocate_slots(request, 0)  # back from swap: blocks for its computed tokens
    back = kv.held_block_ids("a", 30)
    assert len(back) == len(out) == cdiv(30, 4) + 2 * (cdiv(30, 4) - first_kept_entry(8, 30, 4))
    kv.free(request)
    assert kv.pool.num_free_blocks == 64


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    """Gemma 3 text, 5 layers (2 full, 3 sliding with a 16-token window): two tensor
    pairs, three tables (the second sliding table has one layer)."""
    folder = tmp_path_factory.mktemp("gemma3_windowed")
    return make_family_checkpoint(
        folder,
        "gemma3",
        sliding_window=SLIDING,
        num_hidden_layers=5,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        max_position_embeddings=1024,
    )


def _prompts() -> list[list[int]]:
    """A shared 96-token system prompt (6 blocks), then 40-130 tokens of a 10-token phrase
    said over and over (so that prompt lookup finds drafts to propose)."""
    shared = [(7 * i) % 300 + 3 for i in range(96)]
    return [shared + [(11 * i + j) % 300 + 3 for i in range(10)] * (4 + 3 * j) for j in range(4)]


def _run(folder, backend: str, **settings):
    """Greedy tokens of the prompts batched and again alone (over prefix hits), and the
    most blocks any request held in one step."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(
        str(folder),
        dtype="auto" if backend == "cpu" else "float32",  # the fast path picks its own
        attention_backend=backend,
        max_num_batched_tokens=16,
        disable_log_stats=True,
        **settings,
    ) as llm:
        engine = core_of(llm)
        kv = engine.kv_manager
        most = {"blocks": 0}
        allocate = kv.allocate_slots

        def counting(request, *args, **kwargs):
            ok = allocate(request, *args, **kwargs)
            most["blocks"] = max(most["blocks"], kv.num_blocks_of(request.request_id))
            return ok

        kv.allocate_slots = counting  # type: ignore[method-assign]
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        alone = [
            llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            for prompt in prompts
        ]
        stats = engine.counters.snapshot()
        assert kv.pool.num_free_blocks == kv.pool.num_blocks  # nothing leaked
        kv.pool.check_consistency()
        return batched, alone, most["blocks"], kv.num_groups, stats


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_windowed_tables_give_the_tokens_of_one_table_with_fewer_blocks(tiny_gemma3, backend):
    plain = _run(tiny_gemma3, backend, disable_hybrid_kv_cache_manager=True)
    windowed = _run(tiny_gemma3, backend)
    assert plain[3] == 1 and windowed[3] == 3
    assert windowed[0] == plain[0] and windowed[1] == plain[1] == plain[0]
    assert windowed[4]["prefix_cache_hits"] > 0
    # The longest request (226 prompt + 24 tokens): 16 blocks of 5 layers in one table;
    # 16 + 2 x at most 3 blocks of 2 layers in three.
    longest = max(len(p) for p in _prompts()) + 24
    assert plain[2] == cdiv(longest, 16)
    assert windowed[2] <= cdiv(longest, 16) + 2 * (cdiv(SLIDING - 1 + 16, 16) + 1)


@pytest.mark.triton
def test_windowed_tables_on_the_triton_kernels(tiny_gemma3):
    """The Triton kernels (Triton's interpreter here) read and write each layer's group:
    the same tokens as the torch path with one table."""
    plain = _run(tiny_gemma3, "torch", disable_hybrid_kv_cache_manager=True)
    windowed = _run(tiny_gemma3, "triton")
    assert windowed[3] == 3
    assert windowed[0] == plain[0] and windowed[1] == plain[1]


@pytest.fixture(scope="module")
def one_table_tokens(tiny_gemma3):
    """The fast path's tokens with one table per request and whole sequences kept."""
    return _run(tiny_gemma3, "cpu", disable_hybrid_kv_cache_manager=True)


@pytest.mark.parametrize("swap", [0.0, 0.01], ids=["recompute", "swap"])
def test_preempted_windowed_requests_resume_with_the_same_tokens(
    tiny_gemma3, one_table_tokens, swap
):
    tight = _run(
        tiny_gemma3, "cpu", num_kv_blocks=24, max_model_len=256, swap_space=swap,
        enable_prefix_caching=swap == 0.0,
    )  # fmt: skip
    assert tight[4]["num_preemptions"] > 0
    if swap:
        assert tight[4]["blocks_swapped_in"] == tight[4]["blocks_swapped_out"] > 0
    assert tight[0] == one_table_tokens[0] and tight[1] == one_table_tokens[1]


def test_windowed_tables_with_drafts_and_the_kv_disk_tier(tiny_gemma3, one_table_tokens):
    """Prompt-lookup drafts (slots past the computed tokens, rejected ones given back) and
    blocks in the KV disk tier's file (memory for 16 blocks) keep the same tokens."""
    drafted = _run(tiny_gemma3, "cpu", speculative_config=SPEC)
    on_disk = _run(tiny_gemma3, "cpu", num_kv_blocks=16, kv_disk_space=0.002)
    assert drafted[0] == one_table_tokens[0] and drafted[1] == one_table_tokens[1]
    assert (
        drafted[4]["spec_decode_num_draft_tokens"]
        > drafted[4]["spec_decode_num_accepted_tokens"]
        > 0
    )
    assert on_disk[0] == one_table_tokens[0] and on_disk[1] == one_table_tokens[1]
    assert on_disk[4]["kv_disk_blocks_taken"] > 0
