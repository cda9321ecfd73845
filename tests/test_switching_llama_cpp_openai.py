"""Switching to pagedllm by changing the import line only (issue 44): the llama.cpp
wrappers (LangChain's ChatLlamaCpp, LlamaIndex's LlamaCPP) and the OpenAI clients that
vLLM users point at a server (LangChain's ChatOpenAI, LlamaIndex's OpenAILike).

As in test_switching.py, each peer's constructor call as its own documentation shows it
runs with the import changed: the model it names is not here and is refused by name, and
the same call with the default model's file runs and honours its settings.
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from pagedllm_integrations import peer_settings
from pagedllm_integrations.engine.model_loader import default_model_path
from pagedllm_integrations.engine.white_box import core_of

DEFAULT = str(default_model_path())  # the embedded SmolLM2 GGUF, given as a model file
KV = {"kv_cache_memory": 160 << 20}
SMALL = {**KV, "max_model_len": 2048}
# Calls with the SMALL settings share one engine, held for the module (conftest.py).
pytestmark = pytest.mark.usefixtures("small_default_engine")


# ------------------------------------------------------------ ChatLlamaCpp, ChatOpenAI
def test_chat_llama_cpp_as_documented(caplog, monkeypatch):
    import multiprocessing

    import torch

    from pagedllm_integrations.langchain import ChatPagedLLM as ChatLlamaCpp

    monkeypatch.setattr(peer_settings, "_noted", set())  # every note logged again here

    # LangChain's ChatLlamaCpp page: the model file is not here, then the default model's,
    # whose context (8,192) is shorter than n_ctx=10000: refused by the name the user gave.
    def documented(model_path, n_ctx=10000, **engine):
        return ChatLlamaCpp(temperature=0.5, model_path=model_path, n_ctx=n_ctx,
                            n_gpu_layers=8, n_batch=300, max_tokens=512,
                            n_threads=multiprocessing.cpu_count() - 1, repeat_penalty=1.5,
                            top_p=0.5, verbose=True, **engine)  # fmt: skip

    with pytest.raises(ValueError, match="SanctumAI"):
        documented("./SanctumAI-meta-llama-3-8b-instruct.Q8_0.gguf").invoke("Hi")
    with pytest.raises(ValueError, match="n_ctx=10000 exceeds the model's context length 8192"):
        documented(DEFAULT).invoke("Hi")
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        llm = documented(DEFAULT, n_ctx=2048, engine_kwargs=KV)
    try:
        config = llm._config
        assert (config.model, config.max_model_len, config.max_num_batched_tokens) == (
            DEFAULT, 2048, 300
        )  # fmt: skip
        assert config.num_threads == max(1, multiprocessing.cpu_count() - 1)
        assert (llm.temperature, llm.top_p, llm.max_tokens, llm.repetition_penalty) == (
            0.5, 0.5, 512, 1.5
        )  # fmt: skip
        reply = llm.invoke([("system", "Translate the user sentence to French."),
                            ("human", "I love programming.")], max_tokens=16)  # fmt: skip
        assert reply.content and reply.usage_metadata["output_tokens"] <= 16
        # n_threads is the engine thread's kernel pool (the CPU fast path, where it runs).
        if core_of(llm).plan.fused_cpu:
            assert llm.engine.call(torch.ops.pagedllm.pool_threads) == config.num_threads
    finally:
        llm.close()
    assert "n_gpu_layers" in caplog.text  # a partial offload cannot be honoured: noted
    cpu = ChatLlamaCpp(model_path=DEFAULT, n_gpu_layers=0, model_kwargs={"n_batch": 64})
    assert (cpu._config.device, cpu._config.max_num_batched_tokens) == ("cpu", 64)
    with pytest.raises(ValueError, match="lora_path"):
        ChatLlamaCpp(model_path=DEFAULT, lora_path="adapter.bin")


def test_chat_openai_as_documented(caplog, monkeypatch):
    from langchain_core.messages import HumanMessage

    from pagedllm_integrations.engine.sampling_params import RequestOutputKind
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatOpenAI

    monkeypatch.setattr(peer_settings, "_noted", set())  # every note logged again here
    # langchain_openai.ChatOpenAI's docstring ("Instantiate"; model="..." is a placeholder).
    with pytest.raises(ValueError, match="'\\.\\.\\.'"):
        ChatOpenAI(model="...", temperature=0, max_tokens=None, timeout=None,
                   max_retries=2).invoke("Hi")  # fmt: skip
    # ... its "vLLM example with custom parameters": vLLM's beam search is refused by name.
    with pytest.raises(ValueError, match="extra_body\\['use_beam_search'\\]"):
        ChatOpenAI(base_url="http://localhost:8000/v1", api_key="EMPTY",
                   model="meta-llama/Llama-2-7b-chat-hf",
                   extra_body={"use_beam_search": True, "best_of": 4})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        model = ChatOpenAI(base_url="http://localhost:8000/v1", api_key="EMPTY", model=DEFAULT,
                           temperature=0, max_retries=2,
                           extra_body={"top_k": 1, "repetition_penalty": 1.05},
                           model_kwargs={"max_completion_tokens": 12},
                           engine_kwargs=SMALL)  # fmt: skip
    notes = caplog.text
    assert "base_url" in notes and "api_key=<hidden>" in notes and "max_retries" in notes
    assert "EMPTY" not in notes  # a key is never logged
    try:
        assert model.model_kwargs == {"top_k": 1, "repetition_penalty": 1.05, "max_tokens": 12}
        reply = model.invoke("Name three colours.")
        assert 0 < reply.usage_metadata["output_tokens"] <= 12
        final = RequestOutputKind.FINAL_ONLY
        params = model._prepare([HumanMessage("Hi")], None, {}, final)[2].params
        assert (params.top_k, params.repetition_penalty, params.max_tokens) == (1, 1.05, 12)
    finally:
        model.close()


# ------------------------------------------------- LlamaIndex LlamaCPP, OpenAILike
def test_llama_index_llama_cpp_as_documented(caplog, monkeypatch):
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as LlamaCPP

    monkeypatch.setattr(peer_settings, "_noted", set())  # every note logged again here

    def messages_to_prompt(messages):
        prompt = ""
        for message in messages:
            if message.role == "system":
                prompt += f"<|system|>\n{message.content}</s>\n"
            elif message.role == "user":
                prompt += f"<|user|>\n{message.content}</s>\n"
            elif message.role == "assistant":
                prompt += f"<|assistant|>\n{message.content}</s>\n"
        if not prompt.startswith("<|system|>\n"):
            prompt = "<|system|>\n</s>\n" + prompt
        return prompt + "<|assistant|>\n"

    def completion_to_prompt(completion):
        return f"<|system|>\n</s>\n<|user|>\n{completion}</s>\n<|assistant|>\n"

    model_url = (
        "https://huggingface.co/TheBloke/zephyr-7B-beta-GGUF/resolve/main/zephyr-7b-beta.Q4_0.gguf"
    )

    def documented(model_url, model_path, **engine):  # LlamaIndex's LlamaCPP docstring
        return LlamaCPP(model_url=model_url, model_path=model_path, temperature=0.1,
                        max_new_tokens=256, context_window=3900, generate_kwargs={},
                        model_kwargs={"n_gpu_layers": -1},
                        messages_to_prompt=messages_to_prompt,
                        completion_to_prompt=completion_to_prompt, verbose=True,
                        **engine)  # fmt: skip

    with pytest.raises(ValueError, match=r"model_url=.*does not download"):
        documented(model_url, None)
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        llm = documented(None, DEFAULT, engine_kwargs={"kv_cache_memory": 256 << 20})
    try:
        assert (llm._config.model, llm.temperature, llm.max_new_tokens) == (DEFAULT, 0.1, 256)
        response = llm.complete("Hello, how are you?", max_new_tokens=8)
        assert llm.engine.max_model_len == 3900  # context_window
        prompt = completion_to_prompt("Hello, how are you?")  # the user's format wins
        assert response.raw["usage"]["prompt_tokens"] == len(llm.engine.tokenizer(prompt).input_ids)
    finally:
        llm.close()
    assert "verbose" in caplog.text
    tuned = LlamaCPP(model_path=DEFAULT, model_kwargs={"n_ctx": 1024, "n_threads": 1},
                     generate_kwargs={"top_k": 5, "repeat_penalty": 1.2, "max_tokens": 9})  # fmt: skip
    assert (tuned._config.max_model_len, tuned._config.num_threads) == (1024, 1)
    assert tuned.sampling_kwargs == {"top_k": 5, "repetition_penalty": 1.2, "max_tokens": 9}
    with pytest.raises(ValueError, match="generate_kwargs\\['mirostat_mode'\\]"):
        LlamaCPP(model_path=DEFAULT, generate_kwargs={"mirostat_mode": 2})


def test_openai_like_as_documented(caplog, monkeypatch):
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as OpenAILike

    monkeypatch.setattr(peer_settings, "_noted", set())  # every note logged again here

    def documented(model, context_window, **engine):  # OpenAILike's docstring
        return OpenAILike(model=model, api_base="https://hostname.com/v1", api_key="fake",
                          context_window=context_window, is_chat_model=True,
                          is_function_calling_model=False, **engine)  # fmt: skip

    with pytest.raises(ValueError, match="my model"):
        documented("my model", 128000).complete("Hello World!")
    with pytest.raises(ValueError, match="context_window=128000 exceeds the model's context"):
        documented(DEFAULT, 128000).complete("Hello World!")
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        llm = documented(DEFAULT, 2048, max_tokens=24, temperature=0, timeout=60.0,
                         max_retries=3, engine_kwargs=KV,
                         additional_kwargs={"top_k": 1, "extra_body": {"min_tokens": 2}})  # fmt: skip
    try:
        assert (llm.max_new_tokens, llm.timeout) == (24, 60.0)
        assert llm.sampling_kwargs == {"top_k": 1, "min_tokens": 2}
        response = llm.complete("Hello World!")
        assert 2 <= response.raw["usage"]["completion_tokens"] <= 24
    finally:
        llm.close()
    assert "api_key=<hidden>" in caplog.text and "fake" not in caplog.text  # never the key
    assert "api_base" in caplog.text and "max_retries" in caplog.text
