"""ChatPagedLLM features checked where the model's wording does not matter: usage and
metadata against the rendered template, streaming (sync and async, the loop stays free),
concurrent calls batched, tool calls (forced, named, none, streamed as tool_call_chunks),
structured output, logprobs, stop strings, message conversion and errors."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import (
    AIMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from pagedllm_integrations.chat.stream import ToolCallGate
from pagedllm_integrations.chat.tool_calls import CALL_OPEN, render_chat_prompt
from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
from pagedllm_integrations.langchain_messages import to_openai_messages

ENGINE = {"max_model_len": 2048, "kv_cache_memory": 256 << 20}


@pytest.fixture(scope="module")
def chat() -> ChatPagedLLM:
    return ChatPagedLLM(temperature=0, max_tokens=24, engine_kwargs=ENGINE)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def prompt_ids(chat: ChatPagedLLM, messages, tools=None, tool_choice=None) -> list[int]:
    text = render_chat_prompt(
        chat.engine.tokenizer, to_openai_messages(messages), tools=tools, tool_choice=tool_choice
    )
    return chat.engine.tokenizer(text, add_special_tokens=False).input_ids


def test_invoke_reports_usage_and_metadata(chat: ChatPagedLLM) -> None:
    messages = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]
    message = chat.invoke(messages)
    assert message.content
    usage = message.usage_metadata
    assert usage["input_tokens"] == len(prompt_ids(chat, messages))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 < usage["output_tokens"] <= 24
    assert isinstance(usage["input_token_details"]["cache_read"], int)
    meta = message.response_metadata
    assert meta["model_name"] == "SmolLM2-135M-Instruct"
    assert meta["model_provider"] == "pagedllm"
    assert meta["finish_reason"] in ("stop", "length")
    # The same prompt again: its full blocks come from the prefix cache.
    again = chat.invoke(messages)
    block = chat.engine.config.block_size
    assert again.usage_metadata["input_token_details"]["cache_read"] >= (
        (usage["input_tokens"] - 1) // block * block
    )
    assert again.content == message.content


def test_stream_matches_invoke_with_usage_on_the_last_chunk(chat: ChatPagedLLM) -> None:
    question = "Write one sentence about the sea."
    reference = chat.invoke(question)
    chunks = list(chat.stream(question))
    assert len(chunks) > 2
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].chunk_position == "last"
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert full.content == reference.content
    assert full.usage_metadata["output_tokens"] == reference.usage_metadata["output_tokens"]
    assert full.usage_metadata["input_tokens"] == reference.usage_metadata["input_tokens"]
    assert full.response_metadata["model_name"] == "SmolLM2-135M-Instruct"


def test_astream_keeps_the_event_loop_free(chat: ChatPagedLLM) -> None:
    async def run() -> tuple[list[str], float, int]:
        ticks = 0
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                gaps.append(now - last)
                last, ticks = now, ticks + 1

        task = asyncio.create_task(ticker())
        pieces = [c.content async for c in chat.astream("Write one sentence about rain.")]
        stop.set()
        await task
        return pieces, max(gaps), ticks

    pieces, worst_gap, ticks = asyncio.run(run())
    assert len(pieces) > 2
    assert "".join(pieces) == chat.invoke("Write one sentence about rain.").content
    # The loop kept ticking while the engine generated (tokenizing runs in a thread too).
    assert ticks > 5
    assert worst_gap < 1.0, worst_gap


def test_concurrent_calls_share_engine_steps(chat: ChatPagedLLM) -> None:
    engine = chat.engine
    questions = [f"Say the number {i} in words." for i in range(4)]

    def batched_steps(run) -> int:
        steps_before = engine.counters.snapshot()["steps"]
        results = run()
        steps = engine.counters.snapshot()["steps"] - steps_before
        assert len(results) == 4 and all(isinstance(r, AIMessage) for r in results)
        return max(list(engine.counters.batch_sizes)[-steps:])

    assert batched_steps(lambda: chat.batch(questions, max_tokens=12, ignore_eos=True)) >= 4
    assert (
        batched_steps(lambda: asyncio.run(chat.abatch(questions, max_tokens=12, ignore_eos=True)))
        >= 4
    )


def test_forced_tool_call_invoke_and_stream(chat: ChatPagedLLM) -> None:
    # The call markup alone takes ~20 tokens: room for it and the arguments.
    bound = chat.bind_tools([multiply], tool_choice="any", max_tokens=64)
    message = bound.invoke("What is 6 times 7?")
    assert message.content == ""
    (call,) = message.tool_calls
    assert call["name"] == "multiply"
    assert set(call["args"]) == {"a", "b"} and all(
        isinstance(v, int) for v in call["args"].values()
    )
    assert call["id"]
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert any(b["type"] == "tool_call" for b in message.content_blocks)

    chunks = list(bound.stream("What is 6 times 7?"))
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert len(with_calls) == 1
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    (streamed,) = full.tool_calls
    assert (streamed["name"], streamed["args"]) == (call["name"], call["args"])


def test_named_and_none_tool_choice(chat: ChatPagedLLM) -> None:
    named = chat.bind_tools([multiply, get_weather], tool_choice="get_weather", max_tokens=64)
    (call,) = named.invoke("Hello!").tool_calls
    assert call["name"] == "get_weather"
    assert isinstance(call["args"]["city"], str)
    as_dict = chat.bind_tools(
        [multiply, get_weather],
        tool_choice={"type": "function", "function": {"name": "multiply"}},
        max_tokens=64,
    )
    assert as_dict.invoke("Hello!").tool_calls[0]["name"] == "multiply"
    none = chat.bind_tools([multiply], tool_choice="none").invoke("What is 6 times 7?")
    assert none.tool_calls == [] and none.content
    with pytest.raises(ValueError, match=r"names tool .divide., but the tools given"):
        chat.bind_tools([multiply], tool_choice="divide")


def test_tool_history_is_rendered_into_the_prompt(chat: ChatPagedLLM) -> None:
    history = [
        HumanMessage("What is 6 times 7?"),
        AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "c1"}]),
        ToolMessage("42", tool_call_id="c1", name="multiply"),
    ]
    converted = to_openai_messages(history)
    assert converted[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'},
            }
        ],
    }
    assert converted[2] == {
        "role": "tool",
        "content": "42",
        "tool_call_id": "c1",
        "name": "multiply",
    }
    text = chat.engine.tokenizer.decode(prompt_ids(chat, history, tools=None))
    assert CALL_OPEN in text and '"a": 6' in text and "42" in text
    answer = chat.bind_tools([multiply]).invoke(history)
    assert isinstance(answer, AIMessage)


class Person(BaseModel):
    name: str = Field(description="the person's first name")
    age: int = Field(description="the person's age in years")


STRUCTURED_PROMPT = "Alice is 30 years old. Extract the person's name and age."


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_fills_a_pydantic_schema(method: str) -> None:
    chat = ChatPagedLLM(temperature=0, max_tokens=64, repetition_penalty=1.1, engine_kwargs=ENGINE)
    person = chat.with_structured_output(Person, method=method).invoke(STRUCTURED_PROMPT)
    assert isinstance(person, Person)
    as_dict = chat.with_structured_output(Person.model_json_schema(), method=method).invoke(
        STRUCTURED_PROMPT
    )
    assert set(as_dict) == {"name", "age"} and isinstance(as_dict["age"], int)


def test_structured_output_json_mode_and_include_raw() -> None:
    chat = ChatPagedLLM(temperature=0, max_tokens=64, repetition_penalty=1.1, engine_kwargs=ENGINE)
    result = chat.with_structured_output(None, method="json_mode", include_raw=True).invoke(
        STRUCTURED_PROMPT + " Reply in JSON."
    )
    assert set(result) == {"raw", "parsed", "parsing_error"}
    assert isinstance(result["raw"], AIMessage)
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], dict)
    # Streaming a json_schema output yields parsed partial objects, ending complete.
    last = None
    for last in chat.with_structured_output(Person).stream(STRUCTURED_PROMPT):  # noqa: B007
        pass
    assert isinstance(last, Person)
    with pytest.raises(ValueError, match="method"):
        chat.with_structured_output(Person, method="xml")


def test_logprobs_and_stops() -> None:
    chat = ChatPagedLLM(
        temperature=0, max_tokens=8, logprobs=True, top_logprobs=2, engine_kwargs=ENGINE
    )
    message = chat.invoke("Count from one to ten.")
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"]
    assert all(len(t["top_logprobs"]) == 2 for t in content)
    plain = ChatPagedLLM(temperature=0, max_tokens=24, engine_kwargs=ENGINE)
    reference = plain.invoke("Count from one to ten.").content
    assert len(reference) >= 24, reference
    # Stop strings cut at their first occurrence; take two that first occur in this order.
    early, late = reference[8:12], reference[18:22]
    assert reference.index(early) < reference.index(late), reference
    stopped = ChatPagedLLM(temperature=0, max_tokens=24, stop=[late], engine_kwargs=ENGINE)
    assert stopped.invoke("Count from one to ten.").content == reference[: reference.index(late)]
    assert (
        stopped.invoke("Count from one to ten.", stop=[early]).content
        == reference[: reference.index(early)]
    )


def test_tool_call_gate_holds_only_what_may_be_a_call() -> None:
    gate = ToolCallGate(CALL_OPEN)
    assert gate.feed("The answer") == "The answer"
    assert gate.feed(" is <tool") == " is "  # "<tool" may open a call: held
    assert gate.feed("s> here") == "<tools> here"  # it did not
    assert gate.feed(" <tool_call>\n{") == " "
    assert gate.feed('"name": "f"}') == ""
    assert gate.finish() == '<tool_call>\n{"name": "f"}'
    bare = ToolCallGate(CALL_OPEN)
    assert bare.feed("  ") == ""
    assert bare.feed('{"name"') == ""  # an output that opens like a JSON call is held
    assert bare.finish() == '  {"name"'


def test_errors_a_user_can_make(chat: ChatPagedLLM) -> None:
    with pytest.raises(ValueError, match="unknown call argument"):
        chat.invoke("Hi", temprature=0.1)
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([HumanMessage([{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(ValueError, match="unknown engine argument"):
        ChatPagedLLM(engine_kwargs={"max_len": 5})


def test_chat_and_llm_with_equal_settings_share_one_engine(chat: ChatPagedLLM) -> None:
    assert PagedLLM(engine_kwargs=dict(ENGINE)).engine is chat.engine
    assert ChatPagedLLM(model_name=None, engine_kwargs=ENGINE).engine is chat.engine
    ls = chat._get_ls_params(model="override")
    assert (ls["ls_provider"], ls["ls_model_type"], ls["ls_model_name"]) == (
        "pagedllm",
        "chat",
        "override",
    )


def test_n_candidates_in_one_chat_call() -> None:
    chat = ChatPagedLLM(n=3, temperature=1.0, max_tokens=4, seed=11, engine_kwargs=ENGINE)
    result = chat.generate([[HumanMessage("Name an animal.")]], ignore_eos=True)
    (candidates,) = result.generations
    assert len(candidates) == 3
    assert all(c.message.content for c in candidates)
    # Usage is counted once per call: the prompt once, the tokens of all three answers.
    assert result.llm_output["token_usage"]["completion_tokens"] == 3 * 4
