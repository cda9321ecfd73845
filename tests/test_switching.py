"""Switching to pagedllm by changing the import line only (issue 16).

For each library the README names, its constructor call as that library's own
documentation shows it runs unchanged on the embedded default model and honours its
settings, or fails with an error that names what cannot be honoured. The model names in
those calls (an Ollama tag, a hub id) are not on this machine: the call as documented is
refused with a clear error, and the same call with the default model's file runs.
"""

from __future__ import annotations

import importlib
import json
import logging

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from pagedllm_integrations.engine.model_loader import default_model_path

DEFAULT = str(default_model_path())  # the embedded SmolLM2 GGUF, given as a model file
# Engine settings the tests add to keep memory low (the model's context is 8,192 tokens).
KV = {"kv_cache_memory": 160 << 20}
SMALL = {**KV, "max_model_len": 2048}

# Calls with the SMALL settings share one engine, held for the module (conftest.py).
pytestmark = pytest.mark.usefixtures("small_default_engine")


# -------------------------------------------------------------------- ChatOllama
def test_chat_ollama_as_documented():
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatOllama

    # langchain_ollama.ChatOllama's docstring.
    with pytest.raises(ValueError, match="gpt-oss:20b"):
        ChatOllama(model="gpt-oss:20b", validate_model_on_init=True, temperature=0.8,
                   num_predict=256)  # fmt: skip
    model = ChatOllama(model=DEFAULT, validate_model_on_init=True, temperature=0.8,
                       num_predict=256, engine_kwargs=SMALL)  # fmt: skip
    try:
        assert model._engine is not None  # validate_model_on_init loaded it
        assert (model.temperature, model.max_tokens) == (0.8, 256)
        reply = model.invoke([("system", "Translate the user sentence to French."),
                              ("human", "I love programming.")])  # fmt: skip
        assert reply.content and reply.usage_metadata["output_tokens"] <= 256
    finally:
        model.close()


def test_chat_ollama_options_are_mapped_or_noted(caplog):
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatOllama

    colour = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
              "required": ["colour"], "additionalProperties": False}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        model = ChatOllama(model=DEFAULT, temperature=0, num_ctx=1024, num_predict=48,
                           repeat_penalty=1.1, format=colour, keep_alive="5m",
                           base_url="http://localhost:11434", engine_kwargs=KV)  # fmt: skip
    notes = caplog.text
    assert "keep_alive" in notes and "base_url" in notes and "in this process" in notes
    try:
        assert model.repetition_penalty == 1.1 and model.max_tokens == 48
        reply = model.invoke("What colour is the sky? Answer in JSON.")
        assert model.engine.max_model_len == 1024  # num_ctx
        assert json.loads(reply.content)["colour"] in ("red", "green", "blue")  # format
    finally:
        model.close()
    for refused in ({"mirostat": 2}, {"tfs_z": 2.0}, {"reasoning": True}, {"num_gpu": 1}):
        with pytest.raises(ValueError, match=next(iter(refused))):
            ChatOllama(model=DEFAULT, **refused)


# ------------------------------------------------- ChatHuggingFace / HuggingFacePipeline
def test_huggingface_pipeline_and_chat_huggingface_as_documented():
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatHuggingFace
    from pagedllm_integrations.langchain import PagedLLM as HuggingFacePipeline

    # langchain_huggingface.HuggingFacePipeline's docstring, then ChatHuggingFace(llm=...).
    documented = HuggingFacePipeline.from_model_id(
        model_id="gpt2", task="text-generation", pipeline_kwargs={"max_new_tokens": 10}
    )
    with pytest.raises(ValueError, match=r"(?i)gpt2"):
        documented.invoke("Hello")
    hf = HuggingFacePipeline.from_model_id(
        model_id=DEFAULT, task="text-generation",
        pipeline_kwargs={"max_new_tokens": 10, "do_sample": False},
    )  # fmt: skip
    chat = ChatHuggingFace(llm=hf, verbose=True)
    try:
        assert hf.max_new_tokens == 10 and hf._sampling_extra["temperature"] == 0.0
        text = hf.invoke("The capital of France is")
        assert len(hf.get_token_ids(text)) <= 10 + 1
        assert chat.engine is hf.engine  # the chat model serves the pipeline's model
        reply = chat.invoke("Name a colour.")
        assert reply.usage_metadata["output_tokens"] <= 10
    finally:
        chat.close()
        hf.close()
    with pytest.raises(ValueError, match="task='summarization'"):
        HuggingFacePipeline.from_model_id(model_id=DEFAULT, task="summarization")
    with pytest.raises(ValueError, match="takes a PagedLLM"):
        ChatHuggingFace(llm="not an llm")


def test_chat_huggingface_settings_by_their_names():
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatHuggingFace

    chat = ChatHuggingFace(model_id=DEFAULT, stop_sequences=["\n"], max_tokens=20,
                           temperature=0, engine_kwargs=SMALL)  # fmt: skip
    try:
        assert chat.model == DEFAULT and chat.stop == ["\n"]
        assert "\n" not in chat.invoke("Write two lines about the sea.").content
    finally:
        chat.close()


# ---------------------------------------------------------------- VLLM, VLLMOpenAI
def test_vllm_as_documented():
    from pagedllm_integrations.langchain import PagedLLM as VLLM

    # LangChain's VLLM page.
    documented = VLLM(model="mosaicml/mpt-7b", trust_remote_code=True, max_new_tokens=128,
                      top_k=10, top_p=0.95, temperature=0.8)  # fmt: skip
    with pytest.raises(ValueError, match="mosaicml/mpt-7b"):
        documented.invoke("What is the capital of France ?")
    llm = VLLM(model=DEFAULT, trust_remote_code=True, max_new_tokens=128, top_k=10,
               top_p=0.95, temperature=0.8, engine_kwargs=SMALL)  # fmt: skip
    try:
        result = llm.generate(["What is the capital of France ?"], seed=3)
        assert result.llm_output["token_usage"]["completion_tokens"] <= 128
    finally:
        llm.close()


def test_vllm_openai_as_documented(caplog):
    from pagedllm_integrations.langchain import PagedLLM as VLLMOpenAI

    # LangChain's VLLM page, "OpenAI-compatible server" section.
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        llm = VLLMOpenAI(openai_api_key="EMPTY", openai_api_base="http://localhost:8000/v1",
                         model_name=DEFAULT, model_kwargs={"stop": ["."]},
                         engine_kwargs=SMALL)  # fmt: skip
    assert "openai_api_base" in caplog.text
    try:
        assert llm.model == DEFAULT
        text = llm.invoke("Rome is the capital of Italy. Paris is", max_tokens=40, temperature=0)
        assert "." not in text  # the stop string from model_kwargs
    finally:
        llm.close()
    with pytest.raises(ValueError, match="openai_proxy"):
        VLLMOpenAI(model_name=DEFAULT, openai_proxy="http://proxy:3128")


# --------------------------------------------------------- LlamaIndex Ollama, Vllm
def test_llama_index_ollama_as_documented():
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as Ollama

    documented = Ollama(model="llama2", request_timeout=60.0)  # its docstring
    with pytest.raises(ValueError, match="llama2"):
        documented.complete("What is the capital of France?")
    llm = Ollama(model=DEFAULT, request_timeout=60.0, context_window=1024, json_mode=True,
                 additional_kwargs={"num_predict": 60, "temperature": 0, "top_k": 20},
                 engine_kwargs=KV)  # fmt: skip
    try:
        assert llm.timeout == 60.0 and llm.sampling_kwargs["max_tokens"] == 60
        response = llm.complete("What is the capital of France? Answer in JSON.")
        assert llm.metadata.context_window == 1024 and llm.engine.max_model_len == 1024
        assert response.raw["usage"]["completion_tokens"] <= 60
        assert isinstance(json.loads(response.text), dict)  # json_mode: constrained to JSON
    finally:
        llm.close()
    with pytest.raises(ValueError, match="additional_kwargs\\['mirostat'\\]"):
        Ollama(model=DEFAULT, additional_kwargs={"mirostat": 1})


def test_llama_index_vllm_as_documented():
    from llama_index.core.base.llms.types import ChatMessage

    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as Vllm

    def messages_to_prompt(messages):
        prompt = "\n".join([str(x) for x in messages])
        return f"<s>[INST] {prompt} [/INST] </s>\n"

    def completion_to_prompt(completion):
        return f"<s>[INST] {completion} [/INST] </s>\n"

    # llama_index.llms.vllm.Vllm's docstring, with the default model: the model has 3 KV
    # heads, so 4 tensor-parallel ranks are refused by name.
    llm = Vllm(model=DEFAULT, tensor_parallel_size=4, max_new_tokens=256,
               vllm_kwargs={"swap_space": 1, "gpu_memory_utilization": 0.5},
               messages_to_prompt=messages_to_prompt,
               completion_to_prompt=completion_to_prompt)  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size 4"):
        llm.complete("What is a black hole?")
    llm = Vllm(model=DEFAULT, tensor_parallel_size=1, max_new_tokens=24,
               vllm_kwargs={"swap_space": 1, "gpu_memory_utilization": 0.5, "temperature": 0},
               messages_to_prompt=messages_to_prompt,
               completion_to_prompt=completion_to_prompt, engine_kwargs=SMALL)  # fmt: skip
    try:
        assert (llm._config.swap_space, llm._config.gpu_memory_utilization) == (1, 0.5)
        response = llm.complete("What is a black hole?")
        tokenizer = llm.engine.tokenizer
        prompt = completion_to_prompt("What is a black hole?")
        assert response.raw["usage"]["prompt_tokens"] == len(tokenizer(prompt).input_ids)
        assert response.raw["usage"]["completion_tokens"] <= 24
        messages = [ChatMessage(role="user", content="Hi")]
        chat = llm.chat(messages)
        assert chat.raw["usage"]["prompt_tokens"] == len(
            tokenizer(messages_to_prompt(messages)).input_ids
        )
    finally:
        llm.close()
    with pytest.raises(ValueError, match="n=2"):
        Vllm(model=DEFAULT, n=2)
    with pytest.raises(ValueError, match="use_beam_search"):
        Vllm(model=DEFAULT, use_beam_search=True)


# ------------------------------------------------------- foreign names, unknown names
def test_the_settings_issue_16_found_ignored_are_honoured():
    from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM

    assert ChatPagedLLM(model_id="some/model")._config.model == "some/model"
    assert PagedLLM(model_name="some/model")._config.model == "some/model"
    index = PagedLlamaIndexLLM(model_name="some/model", context_window=4096, request_timeout=9)
    assert (index._config.model, index._config.max_model_len, index.timeout) == (
        "some/model",
        4096,
        9,
    )
    chat = ChatPagedLLM(num_predict=64, num_ctx=4096)
    assert (chat.max_tokens, chat._config.max_model_len) == (64, 4096)
    assert ChatPagedLLM(num_predict=-1).max_tokens is None  # Ollama's "no limit"


@pytest.mark.parametrize(
    "module, name",
    [
        ("langchain", "ChatPagedLLM"),
        ("langchain", "PagedLLM"),
        ("llama_index", "PagedLlamaIndexLLM"),
    ],
)
def test_an_unknown_setting_is_refused_by_name(module, name):
    wrapper = getattr(importlib.import_module(f"pagedllm_integrations.{module}"), name)
    with pytest.raises(ValueError, match="no setting 'modle'"):
        wrapper(modle="x")


# ------------------------------------------------------------ OllamaLLM (issue 44)
def test_ollama_llm_as_documented():
    from pagedllm_integrations.langchain import PagedLLM as OllamaLLM

    model = OllamaLLM(model="llama3")  # langchain_ollama.OllamaLLM's docstring
    with pytest.raises(ValueError, match="llama3"):
        model.invoke("Come up with 10 names for a song about parrots")
    model = OllamaLLM(model=DEFAULT, num_predict=20, num_ctx=2048, repeat_penalty=1.1,
                      temperature=0, engine_kwargs=KV)  # fmt: skip
    try:
        assert model.max_new_tokens == 20 and model.vllm_kwargs["repetition_penalty"] == 1.1
        result = model.generate(["Come up with 10 names for a song about parrots"])
        assert model.engine.max_model_len == 2048  # num_ctx
        assert 0 < result.llm_output["token_usage"]["completion_tokens"] <= 20
    finally:
        model.close()
    assert OllamaLLM(model=DEFAULT, num_thread=1)._config.num_threads == 1
    with pytest.raises(ValueError, match="num_ctx=10000 exceeds"):
        OllamaLLM(model=DEFAULT, num_ctx=10000, validate_model_on_init=True)
    with pytest.raises(ValueError, match="mirostat"):
        OllamaLLM(model=DEFAULT, mirostat=2)
