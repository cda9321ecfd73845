"""Every request field of the OpenAI, vLLM and llama.cpp servers is honoured or refused with a
400 naming it (issue 43). Each honoured field is checked against a reference: the engine's
own output for the prompt the field should produce (a truncated prompt, a continued
message, a prompt rendered by transformers from the client's template), or the constraint
the field asks for (a choice, a regex, a schema, a GBNF grammar)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from pagedllm_integrations import EngineConfig, shared_engine
from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.testing import ThreadedServer

ENGINE_ARGS = dict(max_model_len=512, max_num_seqs=64, kv_cache_memory=128 << 20)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine():
    return shared_engine(EngineConfig(disable_log_stats=True, **ENGINE_ARGS))


@pytest.fixture(scope="module")
def http(engine):
    with (
        ThreadedServer(create_app(engine)) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        yield client


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def refused(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param.split(".")[0] in error["message"], error
    return error


def chat(http, **fields) -> dict:
    return http.post(CHAT, json={"messages": USER, "max_tokens": 24, **GREEDY, **fields})


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


# ------------------------------------------------------------------ unknown and refused
def test_an_unknown_field_is_refused_by_name(http, engine):
    error = refused(chat(http, temprature=0.5), "temprature")
    assert error["code"] == "unknown_field" and "--allow-unknown-fields" in error["message"]
    refused(http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "foo": 1}), "foo")
    with (
        ThreadedServer(create_app(engine, allow_unknown_fields=True)) as lenient,
        httpx.Client(base_url=lenient.url, timeout=120) as client,
    ):
        ok(chat(client, temprature=0.5, max_tokens=2))
        # Known fields pagedllm cannot honour stay refused.
        refused(chat(client, use_beam_search=True), "use_beam_search")


def test_a_message_field_that_would_be_dropped_is_refused(http):
    history = [*USER, {"role": "assistant", "content": "Red.", "refusal": None}, *USER]
    ok(http.post(CHAT, json={"messages": history, "max_tokens": 2}))
    history[1]["reasoning_content"] = "The user wants a colour."
    refused(http.post(CHAT, json={"messages": history}), "messages[1].reasoning_content")
    odd = [{**USER[0], "weight": 2}]
    refused(http.post(CHAT, json={"messages": odd}), "messages[0].weight")


@pytest.mark.parametrize(
    ("name", "asks", "neutral"),
    [
        ("use_beam_search", True, False),
        ("length_penalty", 0.5, 1.0),
        ("prompt_logprobs", 1, None),
        ("best_of", 3, 1),
        ("allowed_token_ids", [1, 2], None),
        ("bad_words", ["red"], []),
        ("logits_processors", ["my.Processor"], []),
        ("return_token_ids", True, False),
        ("store", True, False),
        ("modalities", ["text", "audio"], ["text"]),
        ("reasoning_effort", "high", None),
        ("service_tier", "flex", "auto"),
        ("mirostat", 2, 0),
        ("typical_p", 0.5, 1.0),
        ("dry_multiplier", 0.8, 0.0),
        ("n_probs", 5, 0),
        ("id_slot", 3, -1),
        ("samplers", ["top_k"], None),
        ("lora", [{"id": 0, "scale": 1.0}], []),
    ],
)
def test_a_known_field_pagedllm_cannot_honour_is_refused_unless_neutral(http, name, asks, neutral):
    error = refused(chat(http, **{name: asks}), name)
    assert error["code"] == "unsupported_field"
    ok(chat(http, **{name: neutral}, max_tokens=2))


def test_a_setting_that_means_nothing_while_its_switch_is_off_is_accepted(http):
    # llama.cpp clients send every default: mirostat_tau with mirostat off asks nothing.
    ok(chat(http, mirostat=0, mirostat_tau=5.0, dry_base=1.75, repeat_last_n=64, max_tokens=2))
    refused(chat(http, mirostat=2, mirostat_tau=5.0), "mirostat")
    refused(chat(http, repeat_last_n=64, repetition_penalty=1.2), "repeat_last_n")
    ok(chat(http, cache_prompt=False, prompt_cache_key="tenant-a", max_tokens=2))


# ------------------------------------------------------------------ structured outputs
COLOURS = ["red", "green", "blue"]


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_choice": COLOURS},
        {"structured_outputs": {"choice": COLOURS}},
        {"guided_grammar": 'root ::= "red" | "green" | "blue"'},
        {"grammar": 'root ::= ("red" | "green" | "blue")'},  # llama.cpp's GBNF
    ],
)
def test_a_choice_in_every_spelling_constrains_the_answer(http, fields):
    for path in (CHAT, COMPLETIONS):
        body = {"max_tokens": 8, **GREEDY, **fields}
        body |= {"messages": USER} if path == CHAT else {"prompt": "My favourite colour is"}
        answer = ok(http.post(path, json=body))["choices"][0]
        text = answer["message"]["content"] if path == CHAT else answer["text"]
        assert text in COLOURS, (fields, text)


def test_guided_regex_and_json_schemas_constrain_the_answer(http):
    text = content(ok(chat(http, guided_regex=r"[a-z]{3}-[0-9]{2}")))
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text), text
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": COLOURS}, "count": {"type": "integer"}},
        "required": ["colour", "count"],
    }
    for fields in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                   {"json_schema": schema}, {"structured_outputs": {"json": schema}}):  # fmt: skip
        value = json.loads(content(ok(chat(http, max_tokens=40, **fields))))
        assert value["colour"] in COLOURS and isinstance(value["count"], int), fields


def test_response_format_constrains_a_completion_too(http):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": COLOURS}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    body = {"prompt": "A colour as JSON:", "max_tokens": 20, "response_format": response_format}
    text = ok(http.post(COMPLETIONS, json={**body, **GREEDY}))["choices"][0]["text"]
    assert json.loads(text)["colour"] in COLOURS


def test_two_constraints_or_a_foreign_backend_are_refused(http):
    refused(chat(http, guided_regex="a+", guided_choice=COLOURS), "guided_choice")
    both = {"response_format": {"type": "json_object"}, "grammar": 'root ::= "x"'}
    refused(chat(http, **both), "grammar")
    refused(chat(http, guided_choice=COLOURS, guided_decoding_backend="outlines"),
            "guided_decoding_backend")  # fmt: skip
    refused(chat(http, structured_outputs={"choice": COLOURS, "structural_tag": "x"}),
            "structured_outputs.structural_tag")  # fmt: skip


# ------------------------------------------------------------------ prompts
def offline_completion(http, prompt, **fields) -> dict:
    body = {"prompt": prompt, "max_tokens": 12, **GREEDY, **fields}
    return ok(http.post(COMPLETIONS, json=body))


def test_truncate_prompt_tokens_keeps_the_last_tokens(http, engine):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    ids = engine.tokenizer(prompt).input_ids
    truncated = offline_completion(http, prompt, truncate_prompt_tokens=10)
    reference = offline_completion(http, ids[-10:])
    assert truncated["usage"]["prompt_tokens"] == 10
    assert truncated["choices"][0]["text"] == reference["choices"][0]["text"]
    echoed = offline_completion(http, prompt, truncate_prompt_tokens=10, echo=True)
    kept = engine.tokenizer.decode(ids[-10:])
    assert echoed["choices"][0]["text"] == kept + reference["choices"][0]["text"]
    as_chat = ok(chat(http, truncate_prompt_tokens=5, max_tokens=2))
    assert as_chat["usage"]["prompt_tokens"] == 5
    # Past the context, the bound and the exact count both give way to truncation.
    long = ok(http.post(COMPLETIONS, json={"prompt": "word " * 4000, "max_tokens": 2,
                                            "truncate_prompt_tokens": -1}))  # fmt: skip
    assert long["usage"]["prompt_tokens"] == engine.max_model_len - 2


def test_continue_final_message_and_echo(http, engine):
    messages = [*USER, {"role": "assistant", "content": "My favourite colour is"}]
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("My favourite colour is")
    reference = offline_completion(http, text, add_special_tokens=False)
    continued = ok(http.post(CHAT, json={"messages": messages, "max_tokens": 12, **GREEDY,
                                         "continue_final_message": True}))  # fmt: skip
    assert content(continued) == reference["choices"][0]["text"]
    assert continued["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    echoed = ok(http.post(CHAT, json={"messages": messages, "max_tokens": 12, **GREEDY,
                                      "continue_final_message": True, "echo": True}))  # fmt: skip
    assert content(echoed) == "My favourite colour is" + content(continued)
    both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
    refused(http.post(CHAT, json=both), "continue_final_message")


def test_a_client_chat_template_renders_as_transformers_renders_it(http, engine):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | upper }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    text = engine.tokenizer.apply_chat_template(
        USER, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    reference = offline_completion(http, text, add_special_tokens=False)
    rendered = ok(chat(http, chat_template=template, max_tokens=12))
    assert content(rendered) == reference["choices"][0]["text"]
    assert rendered["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 10**10 }}",  # gigabytes
        "{{ ''.__class__.__mro__ }}",  # out of the sandbox
        "{% for m in messages %}{{ m.missing.deeper }}{% endfor %}",  # an error of its own
    ],
)
def test_a_hostile_chat_template_is_a_400(http, template):
    refused(chat(http, chat_template=template), "chat_template")
    ok(chat(http, max_tokens=2))  # and the server goes on


def test_template_kwargs_the_template_does_not_read_are_refused(http):
    refused(chat(http, chat_template_kwargs={"enable_thinking": False}), "chat_template_kwargs")
    refused(chat(http, documents=[{"title": "a", "text": "b"}]), "documents")
    reads = "{% if shout %}LOUD {% endif %}{{ messages[0].content }}"
    ok(chat(http, chat_template=reads, chat_template_kwargs={"shout": True}, max_tokens=2))
    refused(chat(http, chat_template_kwargs={"tokenize": True}), "chat_template_kwargs")


# ------------------------------------------------------------------ legacy functions
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def test_a_forced_legacy_function_call_forces_the_call(http):
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "functions": [WEATHER],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
        **GREEDY,
    }
    choice = ok(http.post(CHAT, json=body))["choices"][0]
    assert choice["finish_reason"] == "function_call"
    call = choice["message"]["function_call"]
    assert "tool_calls" not in choice["message"]
    assert call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"])["city"], str)
    # The call and its result, in the legacy shape, as the next turn's history.
    history = [
        *body["messages"],
        {"role": "assistant", "content": None, "function_call": call},
        {"role": "function", "name": "get_weather", "content": "Sunny, 21 C"},
    ]
    ok(http.post(CHAT, json={"messages": history, "functions": [WEATHER], "max_tokens": 4}))
    both = {**body, "tools": [{"type": "function", "function": WEATHER}]}
    refused(http.post(CHAT, json=both), "functions")


def test_a_streamed_legacy_function_call(http):
    body = {
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "functions": [WEATHER],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
        "stream": True,
        **GREEDY,
    }
    deltas = []
    with http.stream("POST", CHAT, json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0])
    last = deltas[-1]
    assert last["finish_reason"] == "function_call"
    assert last["delta"]["function_call"]["name"] == "get_weather"


# ------------------------------------------------------------------ numbers and names
def test_min_tokens_is_bounded_like_max_tokens(http):
    error = refused(chat(http, min_tokens=2**63 - 1, max_tokens=None), "min_tokens")
    assert error["code"] == "context_length_exceeded"
    refused(http.post(COMPLETIONS, json={"prompt": "hi", "min_tokens": 10**6,
                                         "max_tokens": None}), "min_tokens")  # fmt: skip
    body = ok(chat(http, min_tokens=6, max_tokens=6))
    assert body["usage"]["completion_tokens"] == 6


def test_llama_cpp_names_for_max_tokens_and_repetition_penalty(http):
    five = ok(http.post(COMPLETIONS, json={"prompt": "hi", "n_predict": 5, "ignore_eos": True}))
    assert five["usage"]["completion_tokens"] == 5
    refused(http.post(COMPLETIONS, json={"prompt": "hi", "n_predict": 5, "max_tokens": 6}),
            "n_predict")  # fmt: skip
    llama = ok(chat(http, repeat_penalty=1.3))
    vllm = ok(chat(http, repetition_penalty=1.3))
    assert content(llama) == content(vllm)
    refused(chat(http, repeat_penalty=1.3, repetition_penalty=1.1), "repeat_penalty")


def test_request_id_names_the_response_and_priority_needs_its_policy(http):
    assert ok(chat(http, request_id="job-42", max_tokens=1))["id"] == "chatcmpl-job-42"
    refused(chat(http, request_id="bad id\n"), "request_id")
    ok(chat(http, priority=0, max_tokens=1))
    refused(chat(http, priority=5), "priority")
