"""Defaults a switching user meets first (issue 16), on the default model where one is
involved: answers run to their end, cut-off forced calls say so, the model's own sampling
defaults apply, tokens are counted by the model's tokenizer, LLM.chat describes tools."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from llama_index.core.base.llms.types import ChatMessage
from pydantic import BaseModel

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.chat.errors import IncompleteOutputError
from pagedllm_integrations.chat.tool_calls import parse_tool_calls, render_chat_prompt
from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
from pagedllm_integrations.langchain_messages import to_openai_messages
from pagedllm_integrations.llama_index import PagedLlamaIndexLLM

ENGINE = {"max_model_len": 2048, "kv_cache_memory": 256 << 20}
LONG_ANSWER = "Describe the water cycle in a few sentences."


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def chat() -> ChatPagedLLM:
    return ChatPagedLLM(temperature=0, engine_kwargs=ENGINE)


# ------------------------------------------------------------------ no 16-token cut
def test_chat_answers_run_to_their_end_without_max_tokens(chat):
    message = chat.invoke(LONG_ANSWER)
    assert message.response_metadata["finish_reason"] == "stop"
    assert message.usage_metadata["output_tokens"] > 16  # SamplingParams' own default
    chunks = list(chat.stream(LONG_ANSWER))
    assert "".join(c.content for c in chunks) == message.content


def test_a_forced_tool_call_without_max_tokens_is_complete(chat):
    message = chat.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    city = chat.with_structured_output(City, method="function_calling").invoke(
        "Paris is the capital of France. Extract the city."
    )
    assert isinstance(city, City)


def test_a_cut_off_forced_call_or_structured_output_says_so(chat):
    short = ChatPagedLLM(temperature=0, max_tokens=5, engine_kwargs=ENGINE)
    with pytest.raises(IncompleteOutputError, match="tool call was cut off after 5 tokens"):
        short.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?")
    with pytest.raises(IncompleteOutputError, match="structured output"):
        list(short.with_structured_output(City).stream("Extract: Paris, France."))
    with pytest.raises(IncompleteOutputError, match="max_tokens=5"):
        short.with_structured_output(City, method="function_calling").invoke("Paris, France")
    llama = PagedLlamaIndexLLM(temperature=0, max_new_tokens=5, engine_kwargs=ENGINE)
    with pytest.raises(IncompleteOutputError):
        llama.chat([ChatMessage(role="user", content="Paris, France")],
                   structured_outputs={"json": City.model_json_schema()})  # fmt: skip


def test_completion_wrappers_run_to_the_end_of_the_context(tiny_llama_factory):
    """A model that never says EOS generates until the context is full: nothing stops it
    earlier (PagedLLM used to stop at 512 tokens, the LlamaIndex LLM at 256)."""
    folder = tiny_llama_factory("no-eos", eos_token_id=49151)  # a token it never samples
    engine = {"max_model_len": 600, "num_kv_blocks": 64, "disable_log_stats": True}
    llm = PagedLLM(model=str(folder), temperature=0, engine_kwargs=engine)
    result = llm.generate(["Hello"])
    prompt = result.llm_output["token_usage"]["prompt_tokens"]
    assert result.generations[0][0].generation_info["finish_reason"] == "length"
    assert result.llm_output["token_usage"]["completion_tokens"] == 600 - prompt
    index = PagedLlamaIndexLLM(model=str(folder), temperature=0, engine_kwargs=engine)
    raw = index.complete("Hello").raw
    assert raw["usage"]["completion_tokens"] == 600 - raw["usage"]["prompt_tokens"]
    llm.close()
    index.close()


# --------------------------------------------------------------- generation defaults
def test_generation_config_defaults_apply_and_explicit_settings_win(tiny_llama_factory):
    """As vLLM's --generation-config auto: top_k=1 (greedy) and max_new_tokens=6 from the
    model's generation_config.json are every request's defaults; explicit values win."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_llama_factory("gen-config")
    (folder / "generation_config.json").write_text(
        json.dumps({"temperature": 0.8, "top_k": 1, "max_new_tokens": 6, "eos_token_id": 2})
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The weather is", return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    greedy = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=None)
    reference = greedy[0, ids.shape[1] :].tolist()

    engine = {"num_kv_blocks": 32, "max_model_len": 128, "disable_log_stats": True}
    with LLM(str(folder), **engine) as llm:
        assert llm.get_default_sampling_params().top_k == 1
        (out,) = llm.generate("The weather is", use_tqdm=False)
        assert out.outputs[0].token_ids == reference
        explicit = SamplingParams(temperature=0, max_tokens=3)
        (short,) = llm.generate("The weather is", explicit, use_tqdm=False)
        assert short.outputs[0].token_ids == reference[:3]
    chain = PagedLLM(model=str(folder), engine_kwargs=engine)
    assert chain.get_token_ids("The weather is") == ids[0].tolist()
    assert chain.invoke("The weather is") == tokenizer.decode(reference)
    assert len(chain.get_token_ids(chain.invoke("The weather is", max_tokens=2))) <= 3
    chain.close()


# ------------------------------------------------------------------ token counting
def test_token_counts_come_from_the_engine_tokenizer_offline(chat):
    tokenizer = chat.engine.tokenizer
    text = "Paged attention keeps the KV cache in blocks."
    assert chat.get_token_ids(text) == tokenizer(text, add_special_tokens=False).input_ids
    assert chat.get_num_tokens(text) == len(chat.get_token_ids(text))
    messages = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]
    counted = chat.get_num_tokens_from_messages(messages)
    assert counted == chat.invoke(messages, max_tokens=2).usage_metadata["input_tokens"]
    with_tools = chat.get_num_tokens_from_messages(messages, tools=[get_weather])
    openai_tools = [convert_to_openai_tool(get_weather)]
    rendered = render_chat_prompt(tokenizer, to_openai_messages(messages), tools=openai_tools)
    assert with_tools == len(tokenizer(rendered, add_special_tokens=False).input_ids) > counted
    history = [HumanMessage("a " * 50), AIMessage("b " * 50), HumanMessage("Which colour?")]
    trimmed = trim_messages(history, max_tokens=60, token_counter=chat, strategy="last")
    assert trimmed and trimmed[-1].content == "Which colour?" and len(trimmed) < 3


# ----------------------------------------------------------------------- LLM.chat
def test_llm_chat_describes_tools_with_the_project_renderer(default_llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = SamplingParams(temperature=0, max_tokens=48)
    (out,) = default_llm.chat(messages, params, tools=tools, use_tqdm=False)
    tokenizer = default_llm.get_tokenizer()
    assert out.prompt == render_chat_prompt(tokenizer, messages, tools=tools)
    assert "get_weather" in out.prompt and "<tool_call>" in out.prompt
    assert out.prompt_token_ids == tokenizer(out.prompt, add_special_tokens=False).input_ids
    parse_tool_calls(out.outputs[0].text, tools)  # whatever the model says parses
