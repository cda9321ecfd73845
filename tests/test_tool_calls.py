"""Tool calls: tool specs, prompts with tools, parsing, and calls forced by a grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedllm_integrations.chat.tool_calls import (
    ToolCall,
    normalize_tools,
    parse_tool_calls,
    render_chat_prompt,
    tool_call_constraint,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {  # bare form
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
        },
        "required": ["a", "b"],
    },
}
TOOLS = [WEATHER, ADD]


@pytest.fixture(scope="module")
def tokenizer(default_model_folder):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_model_folder)


# ---------------------------------------------------------------- normalize_tools
def test_normalize_tools_accepts_openai_and_bare_forms():
    tools = normalize_tools(TOOLS)
    assert tools[0] == WEATHER
    assert tools[1] == {"type": "function", "function": {**ADD}}
    no_params = normalize_tools([{"name": "ping"}])[0]["function"]
    assert no_params["parameters"] == {"type": "object", "properties": {}}
    assert no_params["description"] == ""


@pytest.mark.parametrize(
    "bad",
    [
        [{"type": "function", "function": {"description": "no name"}}],
        [{"name": ""}],
        [{"name": "x", "parameters": "not a schema"}],
        [{"type": "retrieval", "function": {"name": "x"}}],
        ["get_weather"],
        [{"name": "x"}, {"name": "x"}],
    ],
)
def test_normalize_tools_rejects_malformed(bad):
    with pytest.raises(ValueError):
        normalize_tools(bad)


# --------------------------------------------------------------- parse_tool_calls
def test_parse_tagged_calls_and_keep_the_rest():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    assert all(isinstance(c, ToolCall) and c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == 2


def test_parse_bare_json_call_and_unclosed_tag():
    content, calls = parse_tool_calls('{"name": "add", "arguments": {"a": 3, "b": 4}}', TOOLS)
    assert content == "" and calls[0].name == "add" and calls[0].arguments == {"a": 3, "b": 4}
    content, calls = parse_tool_calls(
        '```json\n[{"name": "add", "arguments": {"a": 1, "b": 1}}, '
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}]\n```'
    )
    assert [c.name for c in calls] == ["add", "get_weather"] and content == ""
    content, calls = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert calls[0].arguments == {"a": 1, "b": 2} and content == ""


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',  # invalid JSON
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # unknown tool
        '{"name": "delete_all", "arguments": {}}',
        '{"city": "Paris"}',  # JSON, but not a call
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
    ],
)
def test_parse_leaves_non_calls_in_the_text(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert calls == [] and content == text


def test_parse_keeps_bad_block_next_to_good_one():
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls = parse_tool_calls(bad + "\n" + good, TOOLS)
    assert [c.name for c in calls] == ["add"] and content == bad


# ------------------------------------------------------------- render_chat_prompt
def test_render_without_tools_is_the_plain_template(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat_prompt(tokenizer, messages) == expected
    # tool_choice "none" keeps the tools out of the prompt
    assert render_chat_prompt(tokenizer, messages, TOOLS, "none") == expected


def test_render_with_tools_lists_them_in_the_system_prompt(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = render_chat_prompt(tokenizer, messages, TOOLS)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(normalize_tools(TOOLS)[1]["function"]) in system
    assert "<tool_call>" in system and "You must call" not in system
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    forced = render_chat_prompt(tokenizer, messages[1:], TOOLS, "required")
    assert forced.startswith("<|im_start|>system\n# Tools")  # replaces the default system
    assert "You must call at least one of the functions now." in forced
    named = render_chat_prompt(tokenizer, messages[1:], TOOLS, {"function": {"name": "add"}})
    assert "You must call the function add now." in named


def test_render_tool_calls_and_results(tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris and 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    prompt = render_chat_prompt(tokenizer, messages, TOOLS)
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    # the assistant's calls round-trip through parse_tool_calls
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = parse_tool_calls(turn, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 2, "b": 3}),
    ]


def test_render_uses_a_tool_aware_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
    ]
    prompt = render_chat_prompt(tok, messages, TOOLS, add_generation_prompt=False)
    assert prompt == "TOOL get_weather;TOOL add;[user]Paris?[assistant]CALL get_weather Paris"


def test_render_rejects_bad_input(tokenizer):
    with pytest.raises(ValueError):
        render_chat_prompt(tokenizer, [{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError):
        render_chat_prompt(tokenizer, [{"role": "user", "content": "x"}], TOOLS, "nope")


# ---------------------------------------------------------- tool_call_constraint
def test_constraint_modes():
    assert tool_call_constraint(TOOLS, "auto") is None
    assert tool_call_constraint(TOOLS, "none") is None
    assert tool_call_constraint(TOOLS, None) is None
    # True names the only tool (LangChain's meaning, read by normalize_tool_choice).
    assert tool_call_constraint([ADD], True).grammar
    for choice in (
        "required",
        "any",
        "add",
        {"type": "function", "function": {"name": "add"}},
    ):
        assert tool_call_constraint(TOOLS, choice).grammar
    with pytest.raises(ValueError, match="not among"):
        tool_call_constraint(TOOLS, "delete_all")
    with pytest.raises(ValueError):
        tool_call_constraint([], "required")


# ------------------------------------------------------------- on the default model
def _forced_calls(llm, conversations, tools, choice, runs, **extra):
    """`runs` samples for each conversation, all submitted as one batch."""
    from pagedllm_integrations import SamplingParams

    tokenizer = llm.get_tokenizer()
    prompts = []
    for messages in conversations:
        prompt = render_chat_prompt(tokenizer, messages, tools, choice)
        prompts.append({"prompt_token_ids": tokenizer(prompt, add_special_tokens=False).input_ids})
    params = SamplingParams(
        n=runs,
        temperature=0.8,
        seed=7,
        max_tokens=150,
        structured_outputs=tool_call_constraint(tools, choice, **extra),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [sample for output in outputs for sample in output.outputs]


def _check_calls(text, tools, allowed):
    content, calls = parse_tool_calls(text, tools)
    assert content == "" and calls, text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in normalize_tools(tools)}
    for call in calls:
        assert call.name in allowed
        jsonschema.validate(call.arguments, schemas[call.name])
    return calls


QUESTIONS = [
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "user", "content": "What is 17 plus 25?"}],
]


def test_required_tool_choice_always_gives_a_valid_call(default_llm):
    names = set()
    for sample in _forced_calls(default_llm, QUESTIONS, TOOLS, "required", 10):
        assert sample.finish_reason == "stop", sample.text
        calls = _check_calls(sample.text, TOOLS, {"get_weather", "add"})
        assert len(calls) == 1
        names.add(calls[0].name)
    assert names == {"get_weather", "add"}  # the model, not the grammar, picks the tool


def test_named_tool_is_forced(default_llm):
    # The question is about the weather, but tool_choice names "add".
    named = {"type": "function", "function": {"name": "add"}}
    for sample in _forced_calls(default_llm, QUESTIONS[:1], TOOLS, named, 6):
        assert sample.finish_reason == "stop"
        assert [c.name for c in _check_calls(sample.text, TOOLS, {"add"})] == ["add"]


def test_parallel_calls_and_a_tool_without_parameters(default_llm):
    tools = [*TOOLS, {"name": "get_time", "description": "The current time"}]
    messages = [{"role": "user", "content": "Weather in Rome and in Oslo, and the time?"}]
    samples = _forced_calls(
        default_llm, [messages], tools, "required", 6, parallel_tool_calls=True, max_calls=3
    )
    for sample in samples:
        assert sample.finish_reason == "stop", sample.text
        calls = _check_calls(sample.text, tools, {"get_weather", "add", "get_time"})
        assert 1 <= len(calls) <= 3
