"""Closing releases memory: `close()`, `with` blocks and `shutdown_shared_engines()` free an
engine's weights and KV cache once its last user is done (issue 16)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest
import torch

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from pagedllm_integrations import LLM, SamplingParams, shared_engine, shutdown_shared_engines
from pagedllm_integrations.engine.config import EngineConfig
from pagedllm_integrations.engine.white_box import core_of
from pagedllm_integrations.langchain import PagedLLM
from pagedllm_integrations.llama_index import PagedLlamaIndexLLM

ENGINE = {"num_kv_blocks": 64, "max_model_len": 256, "disable_log_stats": True}


def tensor_refs(engine) -> list[weakref.ref]:
    """Weak references to a weight and to the KV cache tensors of an in-process engine."""
    core = core_of(engine)
    refs = [weakref.ref(next(core.model.parameters()))]
    refs += [weakref.ref(t) for layer in core.executor.kv_caches for t in layer]
    return refs


def all_freed(refs: list[weakref.ref]) -> bool:
    gc.collect()
    return all(ref() is None for ref in refs)


def test_llm_close_and_with_block_free_weights_and_kv_cache(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    assert llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    refs = tensor_refs(llm.engine)
    llm.close()
    assert all_freed(refs)
    # The engine keeps what front ends read (and says it is down).
    assert not llm.engine.is_running and llm.engine.model_info.max_model_len == 256
    with LLM(str(tiny_llama_dir), **ENGINE) as llm:
        refs = tensor_refs(llm.engine)
    assert all_freed(refs)


def test_wrappers_sharing_an_engine_free_it_when_the_last_one_closes(tiny_llama_dir):
    model = str(tiny_llama_dir)
    chain = PagedLLM(model=model, max_new_tokens=2, engine_kwargs=ENGINE)
    index = PagedLlamaIndexLLM(model=model, max_new_tokens=2, engine_kwargs=ENGINE)
    chain.invoke("Hello")
    index.complete("Hello")
    engine = chain.engine
    assert index.engine is engine  # one engine for both
    refs = tensor_refs(engine)
    chain.close()
    assert engine.is_running  # the LlamaIndex wrapper still holds it
    assert index.complete("Hello").text is not None
    index.close()
    assert not engine.is_running and all_freed(refs)
    # A closed wrapper loads the model again on its next call; `with` closes it.
    with PagedLLM(model=model, max_new_tokens=2, engine_kwargs=ENGINE) as again:
        again.invoke("Hello")
        fresh = again.engine
        assert fresh is not engine
        refs = tensor_refs(fresh)
    assert not fresh.is_running and all_freed(refs)


def test_shutdown_shared_engines_frees_engines_taken_without_an_owner(tiny_llama_dir):
    engine = shared_engine(EngineConfig(model=str(tiny_llama_dir), **ENGINE))
    engine.add_request("Hello", SamplingParams(max_tokens=2)).result()
    refs = tensor_refs(engine)
    shutdown_shared_engines()
    assert not engine.is_running and all_freed(refs)


# Resident memory, measured in a fresh process so that nothing else in it moves the numbers.
_RSS_SCRIPT = """
import gc, json, os
from pagedllm_integrations.langchain import ChatPagedLLM

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

warm = ChatPagedLLM(max_tokens=2, engine_kwargs={"kv_cache_memory": 32 << 20, "max_model_len": 512})
warm.invoke("Hi")  # imports, thread pools and caches a first call creates, then gone
warm.close()
gc.collect()
before = rss()
chat = ChatPagedLLM(max_tokens=4, engine_kwargs={"kv_cache_memory": 256 << 20, "max_model_len": 2048})
chat.invoke("Hi")
loaded = rss()
chat.close()
after = rss()
print(json.dumps({"before": before, "loaded": loaded, "after": after}))
"""


def test_resident_memory_drops_back_after_close():
    done = subprocess.run(
        [sys.executable, "-P", "-c", _RSS_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    grew = rss["loaded"] - rss["before"]
    left = rss["after"] - rss["before"]
    print({k: round(v / 2**20) for k, v in rss.items()}, "MiB")
    # The weights (packed on the CPU fast path, ~100 MiB; float32 elsewhere, ~540 MiB) and
    # the KV cache blocks the call used (the 256 MiB cache's pages come zeroed from the
    # kernel on first touch, so only those are resident): most of it must go back.
    assert grew > 150 * 2**20, rss
    assert left < 0.25 * grew, rss


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_second_engine_gets_the_full_kv_budget_after_close():
    first = LLM(gpu_memory_utilization=0.5, disable_log_stats=True)
    blocks = first.engine.num_total_blocks()
    first.close()
    second = LLM(gpu_memory_utilization=0.5, disable_log_stats=True)
    try:
        # Without the release, the first engine's weights and KV cache would count against
        # the second one's budget and leave it a fraction of the blocks.
        assert second.engine.num_total_blocks() >= 0.97 * blocks
    finally:
        second.close()


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(path) for line in maps)


def test_the_gguf_file_is_unmapped_once_its_weights_are_read():
    """The file's mapping goes with the last tensor taken from it, without waiting for the
    cyclic garbage collector (which a busy engine may not run for its whole life: the
    default model's file then stayed ~50 MiB resident)."""
    from pagedllm_integrations.engine.gguf_loader import iter_gguf_weights
    from pagedllm_integrations.engine.model_loader import default_model_path, resolve_model

    path = str(default_model_path().resolve())
    folder = resolve_model(None).folder
    gc.disable()
    try:
        weights = iter_gguf_weights(folder)
        next(weights)
        assert _mapped(path)
        for _ in weights:
            pass
        assert not _mapped(path)
    finally:
        gc.enable()
