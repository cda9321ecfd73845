"""Each family's tool-call format on its own chat template: a forced call renders, is
constrained by the grammar, and parses; the format is chosen from the model.

The templates below are written here to produce each family's official format (they are the
format under test): Qwen3's tool-aware ChatML (tools listed in the system turn inside
<tools></tools>, calls as <tool_call> JSON, results as <tool_response> in a user turn),
Gemma 3's (turns of user/model, the system text folded into the first user turn, no tool
syntax of its own), Phi-4-mini's (tools as a JSON string in the system message's `tools`
field, written between <|tool|> and <|/tool|>). The tiny random checkpoints cannot choose a
tool well; what is checked is the markup, the schema-valid arguments and the round trip.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from family_checkpoints import make_family_checkpoint

from pagedllm_integrations import LLM, SamplingParams
from pagedllm_integrations.chat.tool_calls import (
    parse_tool_calls,
    render_chat_prompt,
    tool_call_constraint,
)
from pagedllm_integrations.chat.tool_formats import model_tool_format
from pagedllm_integrations.engine.white_box import core_of

QWEN3_TEMPLATE = (
    r"{%- if tools %}"
    r"{{- '<|im_start|>system\n' }}"
    r"{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}"
    r"{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}"
    r"{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    r"{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}"
    r"{{- '\n</tools>\n\nFor each function call, return a json object with function name and' }}"
    r"{{- ' arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}"
    r'{{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}" }}'
    r"{{- '\n</tool_call><|im_end|>\n' }}"
    r"{%- elif messages[0].role == 'system' %}"
    r"{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    r"{%- endif %}"
    r"{%- for message in messages %}"
    r"{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    r"{%- elif message.role == 'assistant' %}"
    r"{{- '<|im_start|>assistant\n' + (message.content or '') }}"
    r"{%- for call in message.tool_calls or [] %}"
    r"{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}"
    r'{{- "<tool_call>\n{\"name\": \"" + call.function.name + "\", \"arguments\": " }}'
    r"{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}"
    r"{%- endfor %}{{- '<|im_end|>\n' }}"
    r"{%- elif message.role == 'tool' %}"
    r"{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    r"{{- '<|im_start|>user' }}{%- endif %}"
    r"{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    r"{{- '<|im_end|>\n' }}{%- endif %}"
    r"{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    r"{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    r"{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    r"{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and 'tools' in message and message['tools'] is not none %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools']"
    " + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
# family -> (template, expected format, how a forced call starts)
CASES = {
    "qwen3": (QWEN3_TEMPLATE, "hermes", '<tool_call>\n{"name": '),
    "gemma3": (GEMMA3_TEMPLATE, "gemma", '{"name": '),
    "phi4_mini": (PHI4_MINI_TEMPLATE, "phi4", '<|tool_call|>[{"name": '),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module", params=list(CASES))
def family_llm(request, tmp_path_factory):
    from transformers import AutoTokenizer

    kind = request.param
    # The tiny tokenizer spells the tool sections out in several hundred tokens: room for them.
    folder = make_family_checkpoint(
        tmp_path_factory.mktemp(kind), kind, shards=1, max_position_embeddings=2048
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CASES[kind][0]
    tokenizer.save_pretrained(folder)
    max_model_len = 2048
    with LLM(
        str(folder), dtype="float32", disable_log_stats=True, max_model_len=max_model_len
    ) as llm:
        yield kind, llm


def _forced(llm, messages, tool_choice, max_tokens=120, **constraint_args):
    engine = core_of(llm)
    fmt = model_tool_format(llm.engine)
    prompt = render_chat_prompt(engine.tokenizer, messages, TOOLS, tool_choice, tool_format=fmt)
    constraint = tool_call_constraint(TOOLS, tool_choice, tool_format=fmt, **constraint_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    output = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    # What the model wrote, markers included (Phi's <|tool_call|> is a special token, which
    # the output text leaves out); the calls are parsed from the output text as served.
    written = engine.tokenizer.decode(output.token_ids, skip_special_tokens=False)
    content, calls = parse_tool_calls(output.text, TOOLS, fmt)
    return prompt, written, content, calls


def test_format_is_chosen_from_the_model(family_llm):
    kind, llm = family_llm
    assert model_tool_format(llm.engine).name == CASES[kind][1]


def test_tools_render_in_the_family_prompt(family_llm):
    kind, llm = family_llm
    prompt, *_ = _forced(llm, HISTORY[:2], "required")
    definition = json.dumps(WEATHER["function"])
    if kind == "qwen3":  # the template's own tool section
        assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
        assert "<tools>\n" + json.dumps(WEATHER) in prompt
    elif kind == "phi4_mini":  # the system message's tools field, between <|tool|> tags
        assert prompt.startswith("<|system|>Be brief.")
        assert f"<|tool|>[{definition}, " in prompt and "<|/tool|><|end|><|user|>" in prompt
        assert prompt.endswith("<|user|>Weather in Paris?<|end|><|assistant|>")
    else:  # Gemma: instructions and definitions folded into the first user turn
        assert prompt.startswith("<bos><start_of_turn>user\nBe brief.\n\nYou have access to")
        assert '"name": "get_weather"' in prompt
        assert prompt.endswith("Weather in Paris?<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}]
)
def test_forced_call_constrains_and_parses(family_llm, tool_choice):
    kind, llm = family_llm
    _, text, content, calls = _forced(llm, HISTORY[:2], tool_choice)
    assert text.startswith(CASES[kind][2]), text
    assert len(calls) == 1 and content == ""
    call = calls[0]
    if isinstance(tool_choice, dict):
        assert call.name == "add"
    jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_parallel_forced_calls(family_llm):
    _, llm = family_llm
    _, text, _, calls = _forced(llm, HISTORY[:2], "required", parallel_tool_calls=True, max_calls=3)
    assert 1 <= len(calls) <= 3, text
    for call in calls:
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_earlier_calls_and_results_render_and_round_trip(family_llm):
    kind, llm = family_llm
    engine = core_of(llm)
    prompt = render_chat_prompt(
        engine.tokenizer, HISTORY, TOOLS, tool_format=model_tool_format(llm.engine)
    )
    if kind == "qwen3":
        call_text = (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        )
        assert f"<|im_start|>assistant\n{call_text}<|im_end|>\n" in prompt
        assert (
            "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
        )
    elif kind == "phi4_mini":
        call_text = (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|>'
        )
        assert f"<|assistant|>{call_text}<|end|><|tool|>18 C, sunny<|end|><|assistant|>" in prompt
    else:
        call_text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
        assert f"<start_of_turn>model\n{call_text}<end_of_turn>\n" in prompt
        assert "<start_of_turn>user\n18 C, sunny<end_of_turn>\n<start_of_turn>model\n" in prompt
    _, calls = parse_tool_calls(call_text, TOOLS, model_tool_format(llm.engine))
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_each_format_parses_its_markup():
    """Hand-written outputs in each family's markup (and the variants models write)."""
    cases = [
        (
            "hermes",
            'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        ),
        (
            "phi4",
            'Sure.<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}]<|/tool_call|>',
        ),
        ("phi4", '[{"name": "add", "arguments": {"a": 1, "b": 2}}]<|/tool_call|>'),  # tag skipped
        ("gemma", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
        ("gemma", "```tool_code\n[add(a=1, b=2)]\n```"),  # the guide's Python variant
    ]
    for name, text in cases:
        for fmt in (name, None):  # the model's format, or any known one
            content, calls = parse_tool_calls(text, TOOLS, fmt)
            assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2})], text
            assert content in ("", "Sure."), (text, content)
    two = (
        '{"name": "add", "parameters": {"a": 1, "b": 2}}\n'
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    )
    assert [c.name for c in parse_tool_calls(two, TOOLS, "gemma")[1]] == ["add", "get_weather"]
    python = '[add(a=1, b=2), get_weather(city="Oslo", unit="celsius")]'
    assert [c.arguments for c in parse_tool_calls(python, TOOLS, "gemma")[1]] == [
        {"a": 1, "b": 2},
        {"city": "Oslo", "unit": "celsius"},
    ]
    # an unknown tool, or text that only looks like a call, stays content
    for name, text in [
        ("phi4", '<|tool_call|>[{"name": "rm", "arguments": {}}]<|/tool_call|>'),
        ("gemma", "[print(x)]"),
        ("gemma", "The answer is 3."),
    ]:
        assert parse_tool_calls(text, TOOLS, name) == (text, [])


def test_langchain_bind_tools_speaks_the_model_format(family_llm):
    """ChatPagedLLM renders, forces and parses (invoke and stream) in the model's markup."""
    from langchain_core.messages import AIMessageChunk

    from pagedllm_integrations.langchain import ChatPagedLLM

    _, llm = family_llm
    chat = ChatPagedLLM(
        model=str(core_of(llm).model_folder),
        temperature=0,
        max_tokens=120,
        dtype="float32",
        engine_kwargs=dict(max_model_len=2048, disable_log_stats=True),
    )
    try:
        bound = chat.bind_tools(TOOLS, tool_choice="add")
        message = bound.invoke("What is 2 + 3?")
        assert [call["name"] for call in message.tool_calls] == ["add"]
        jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["add"])
        merged = None
        for chunk in bound.stream("What is 2 + 3?"):
            assert isinstance(chunk, AIMessageChunk)
            merged = chunk if merged is None else merged + chunk
        assert merged is not None and [c["name"] for c in merged.tool_calls] == ["add"]
        assert merged.tool_calls[0]["args"] == message.tool_calls[0]["args"]  # greedy: same
    finally:
        chat.engine.shutdown()  # this test's own shared engine (a tiny model's)


def test_format_choice_from_template_and_architecture():
    from types import SimpleNamespace

    from pagedllm_integrations.chat.tool_formats import tool_format_for

    def chosen(template, architecture=None):
        return tool_format_for(SimpleNamespace(chat_template=template), architecture).name

    assert chosen(QWEN3_TEMPLATE) == "hermes"
    assert chosen(GEMMA3_TEMPLATE) == "gemma"
    assert chosen(PHI4_MINI_TEMPLATE) == "phi4"
    llama3 = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
    assert chosen("{{ tools }}" + llama3, "LlamaForCausalLM") == "gemma"
    # a template that says nothing about tools: the family decides, else Hermes
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chosen(plain, "Gemma2ForCausalLM") == "gemma"
    assert chosen(plain, "Phi3ForCausalLM") == "phi4"
    assert chosen(plain, "Qwen3ForCausalLM") == chosen(plain) == "hermes"
