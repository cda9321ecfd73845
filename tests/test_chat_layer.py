"""The chat layer shared by every front end (pagedllm_integrations/chat/): one tool_choice
normalizer, one rule for tools against structured output with the same answer in
LangChain, LlamaIndex, the server and LLM.chat, and the streamed-choice reader."""

from __future__ import annotations

import pytest

from pagedllm_integrations.chat.errors import ChatRequestError
from pagedllm_integrations.chat.outputs import Usage, read_choice
from pagedllm_integrations.chat.stream import ChoiceStream
from pagedllm_integrations.chat.tool_calls import format_call, normalize_tools
from pagedllm_integrations.chat.tool_choice import normalize_tool_choice, plan_tools
from pagedllm_integrations.engine.outputs import CompletionOutput, RequestOutput
from pagedllm_integrations.engine.sampling_params import SamplingParams, StructuredOutputsParams

TOOLS = normalize_tools(
    [
        {"name": "get_weather", "parameters": {"type": "object",
         "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        {"name": "lookup"},
    ]
)  # fmt: skip
NAMED = {"type": "function", "function": {"name": "lookup"}}
CONFLICT = "tools .* and a structured output cannot both shape one answer"


@pytest.mark.parametrize(
    "given, expected",
    [
        (None, "auto"),
        ("auto", "auto"),
        ("none", "none"),
        (False, "none"),
        ("any", "required"),  # LangChain
        ("required", "required"),  # OpenAI, LlamaIndex tool_required
        ("lookup", NAMED),  # LangChain: a tool name
        ({"name": "lookup"}, NAMED),  # LangChain's short dict
        (NAMED, NAMED),  # OpenAI
    ],
)
def test_every_spelling_of_tool_choice_means_one_thing(given, expected):
    assert normalize_tool_choice(given, TOOLS) == expected


@pytest.mark.parametrize(
    "given, tools, message",
    [
        ("required", [], "no tools were given"),
        ("divide", TOOLS, "'divide', but the tools given are"),
        (True, TOOLS, "exactly one tool"),
        ({"type": "web_search"}, TOOLS, "type must be 'function'"),
        (3, TOOLS, "tool_choice must be"),
    ],
)
def test_bad_tool_choice_names_the_field(given, tools, message):
    with pytest.raises(ChatRequestError, match=message) as caught:
        normalize_tool_choice(given, tools)
    assert caught.value.param == "tool_choice"


def test_the_plan_for_tools_and_structured_output():
    schema = StructuredOutputsParams(json={"type": "object"})
    assert plan_tools(None, None, schema).forced == "structured output"
    offered = plan_tools(TOOLS, "auto")
    assert offered.tools == TOOLS and offered.constraint is None and offered.forced is None
    forced = plan_tools(TOOLS, "any")
    assert forced.constraint is not None and forced.forced == "tool call"
    assert plan_tools(TOOLS, "none", schema).tools is None  # tools withdrawn: no conflict
    for choice in ("auto", "required", NAMED):
        with pytest.raises(ChatRequestError, match=CONFLICT) as caught:
            plan_tools(TOOLS, choice, schema)
        assert caught.value.param == "response_format"


def _completion(text: str, tokens: int, finish: str | None) -> CompletionOutput:
    return CompletionOutput(0, text, list(range(tokens)), finish_reason=finish)


def test_a_streamed_choice_shows_text_at_once_and_holds_calls_back():
    stream = ChoiceStream(plan_tools(TOOLS, "auto"))
    call = format_call("lookup", {})
    shown = [stream.feed(_completion(part, 1, None)).text for part in ("Sure. ", call[:5])]
    assert shown == ["Sure. ", ""]  # the start of a <tool_call> tag is held
    last = stream.feed(_completion(call[5:], 3, "stop"))
    assert last.done is not None and last.done.finish_reason == "tool_calls"
    assert [c.name for c in last.done.tool_calls] == ["lookup"]
    assert last.done.content == "Sure. " and stream.num_tokens == 5
    plain = ChoiceStream(None)
    assert plain.feed(_completion("{not held}", 2, "stop")).text == "{not held}"


def test_read_choice_and_usage():
    plan = plan_tools(TOOLS, "auto")
    choice = read_choice(format_call("get_weather", {"city": "Oslo"}), "stop", plan)
    assert choice.finish_reason == "tool_calls" and choice.tool_calls[0].arguments == {
        "city": "Oslo"
    }
    assert read_choice("no call", "length", plan).finish_reason == "length"
    output = RequestOutput("r", None, [1, 2, 3], [_completion("x", 4, "stop")], True,
                           num_cached_tokens=2)  # fmt: skip
    assert Usage.of([output, output]).to_openai() == {
        "prompt_tokens": 6,
        "completion_tokens": 8,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_the_same_conflict_gets_the_same_answer_in_every_front_end(default_llm):
    """Tools with a structured output: LangChain, LlamaIndex and LLM.chat raise the same
    ValueError, the server answers 400 with that message (param response_format)."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient
    from llama_index.core.base.llms.types import ChatMessage

    from pagedllm_integrations.langchain import ChatPagedLLM
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM
    from pagedllm_integrations.server.app import create_app

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {}}}
    messages = [{"role": "user", "content": "Hi"}]
    errors = []
    chat = ChatPagedLLM(engine_kwargs={"max_model_len": 2048, "kv_cache_memory": 256 << 20})
    with pytest.raises(ValueError, match=CONFLICT) as caught:
        chat.bind_tools([tool]).bind(structured_outputs={"json": schema}).invoke("Hi")
    errors.append(str(caught.value))
    index = PagedLlamaIndexLLM(engine_kwargs={"max_model_len": 2048, "kv_cache_memory": 256 << 20})
    with pytest.raises(ValueError, match=CONFLICT) as caught:
        index.chat([ChatMessage(role="user", content="Hi")], tools=[tool],
                   structured_outputs=StructuredOutputsParams(json=schema))  # fmt: skip
    errors.append(str(caught.value))
    with pytest.raises(ValueError, match=CONFLICT) as caught:
        structured = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
        default_llm.chat(messages, structured, tools=[tool], use_tqdm=False)
    errors.append(str(caught.value))
    with TestClient(create_app(default_llm.engine)) as client:
        response = client.post("/v1/chat/completions", json={
            "messages": messages, "tools": [tool],
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
        })  # fmt: skip
    assert response.status_code == 400
    body = response.json()["error"]
    assert body["param"] == "response_format"
    errors.append(body["message"])
    assert len(set(errors)) == 1, errors
