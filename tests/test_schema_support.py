"""JSON schemas the grammar cannot enforce are refused, naming the keyword (issue 43); what is
let through, the grammar enforces. The reference is the jsonschema library; the grammar is
xgrammar's, built with the options the engine compiles with (no model needed, except for
the last tests, which go through the default engine)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.chat.tool_calls import tool_call_constraint
from pagedllm_integrations.engine.sampling_params import StructuredOutputsParams as Structured
from pagedllm_integrations.engine.schema_support import check_enforceable
from pagedllm_integrations.engine.structured_outputs import JSON_SEPARATORS
from pagedllm_integrations.engine.white_box import core_of


def grammar_accepts(schema: dict, value) -> bool:
    """Whether the grammar the engine would compile for `schema` lets `value` through."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
    )
    return _is_grammar_accept_string(grammar, json.dumps(value, separators=JSON_SEPARATORS))


def valid(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (the keyword named, schema, a value the grammar writes although the schema forbids it)
BROKEN_TODAY = [
    ("not", {"not": {"type": "string"}}, "a"),
    ("pattern", {"type": "string", "pattern": "^(?!abc)[a-z]+$"}, "abcd"),
    ("if", {"if": {"type": "integer"}, "then": {"minimum": 5}}, 2),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 1.3),
    ("required", {"type": "object", "required": ["x"]}, {}),
    ("required", {**OBJ, "required": ["a", "x"]}, {"a": 1}),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1),
    ("allOf", {"allOf": [{"type": "integer"}, {"maximum": 5}]}, 7),
    ("maxLength", {"type": "string", "enum": ["abc", "de"], "maxLength": 2}, "abc"),
    ("minimum", {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 5}, 1),
    ("minimum", {"minimum": 1, "maximum": 5}, 7),
    ("maxLength", {"maxLength": 2}, "abc"),
    ("type", {"type": "integer", "anyOf": [{"type": "integer"}, {"type": "string"}]}, "a"),
    ("format", {"type": "string", "format": "idn-email"}, "x"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    ("dependentRequired", {**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    ("enum", {"type": "string", "enum": ["a", 1]}, 1),
]
# Not even valid JSON Schema, yet compiled and run today.
INVALID_SCHEMAS = [
    ("maxLength", {"type": "string", "maxLength": -1}),
    ("anyOf", {"anyOf": []}),
    ("type", {"type": []}),
    ("required", {**OBJ, "required": ["a", "a"]}),
    ("minItems", {"type": "array", "minItems": -1}),
]
OTHER_REFUSALS = [
    ("else", {"type": "integer", "else": {"minimum": 1}}),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}),
    ("propertyNames", {"type": "object", "propertyNames": {"pattern": "^a"}}),
    ("$ref", {"$ref": "https://example.com/schema.json"}),
    ("$ref", {"$ref": "#/$defs/missing"}),
    ("exclusiveMinimum", {"type": "integer", "minimum": 3, "exclusiveMinimum": True}),
    ("multipleOf", {"type": "integer", "multipleOf": 1.5}),
    ("pattern", {"type": "string", "pattern": "^[a-z]+(?<!z)$"}),
    ("items", {"type": "array", "items": [{"type": "integer"}]}),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}),
    ("not", {"type": "object", "properties": {"deep": {"type": "array", "items": {"not": {}}}}}),
]


@pytest.mark.parametrize("keyword, schema, value", BROKEN_TODAY)
def test_what_the_grammar_would_break_is_refused_naming_the_keyword(keyword, schema, value):
    # The grammar alone lets through a value the schema forbids...
    assert grammar_accepts(schema, value) and not valid(schema, value)
    # ...so the schema is refused before it is compiled.
    with pytest.raises(ValueError, match=re.escape(f"uses '{keyword}' at #")):
        check_enforceable(schema)


@pytest.mark.parametrize("keyword, schema", INVALID_SCHEMAS + OTHER_REFUSALS)
def test_invalid_or_unenforceable_schemas_are_refused_naming_the_keyword(keyword, schema):
    with pytest.raises(ValueError, match=re.escape(f"uses '{keyword}' at #")):
        check_enforceable(schema)


def test_the_refusal_says_where_and_what_to_do():
    schema = {"type": "object", "properties": {"a b": {"type": "number", "multipleOf": 2}}}
    with pytest.raises(ValueError) as caught:
        check_enforceable(schema, "the response_format schema")
    message = str(caught.value)
    assert message.startswith("the response_format schema uses 'multipleOf' at #/properties/a b")
    assert '"type": "integer"' in message


# (schema, values it allows, values it forbids): the grammar must agree with jsonschema.
ENFORCED = [
    ({"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 10}, [3, 9], [4, 12, 0]),
    ({"type": ["integer", "null"], "minimum": 3}, [5, None], [1, "a"]),
    ({"type": "number", "exclusiveMinimum": 1.5, "exclusiveMaximum": 5}, [3.2], [1.5, 5]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc"], ["a", "abcd"]),
    ({"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}, ["AB1"], ["ab1", "AB12"]),
    ({"type": "string", "format": "date"}, ["2024-01-31"], ["hello"]),
    ({"type": "string", "format": "email"}, ["a@b.com"], ["hello"]),
    ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["x"]),
    ({"type": "string", "format": "ipv4"}, ["1.2.3.4"], ["1.2.3"]),
    ({"enum": ["red", 2, None]}, ["red", 2, None], ["blue", 3]),
    ({"type": "string", "const": "v1"}, ["v1"], ["v2"]),
    ({**OBJ, "required": ["a"], "additionalProperties": False}, [{"a": 1}], [{}, {"c": 1}]),
    ({**OBJ, "minProperties": 1, "maxProperties": 1}, [{"a": 1}], [{}, {"a": 1, "b": 2}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, [{"k": 1}], [{"k": "x"}]),
    (
        {
            "type": "array",
            "prefixItems": [{"type": "integer"}],
            "items": {"type": "string"},
            "minItems": 2,
            "maxItems": 3,
        },
        [[1, "a"], [1, "a", "b"]],
        [[1], ["a", "a"], [1, "a", "b", "c"]],
    ),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [1, "ab"], ["abc"]),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, [1, "a"], [True, 1.5]),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, [4], [1]),
    (
        {
            "$defs": {"p": {"type": "integer", "minimum": 0}},
            "type": "object",
            "properties": {
                "x": {"$ref": "#/$defs/p", "description": "annotations may sit beside $ref"}
            },
            "required": ["x"],
        },
        [{"x": 1}],
        [{"x": -1}, {}],
    ),
    (
        {
            "type": "object",
            "properties": {"c": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["c"],
        },
        [{"c": [{"c": []}]}],
        [{"c": [{}]}],
    ),
]


@pytest.mark.parametrize("schema, allowed, forbidden", ENFORCED)
def test_what_is_let_through_the_grammar_enforces(schema, allowed, forbidden):
    check_enforceable(schema)
    for value in allowed:
        assert valid(schema, value) and grammar_accepts(schema, value), value
    for value in forbidden:
        assert not valid(schema, value) and not grammar_accepts(schema, value), value


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int = pydantic.Field(ge=0, le=9)


class Dog(pydantic.BaseModel):
    kind: Literal["dog"]
    name: str = pydantic.Field(max_length=20, pattern="^[A-Z][a-z]+$")


class Owner(pydantic.BaseModel):
    pet: Cat | Dog = pydantic.Field(discriminator="kind")
    nickname: str | None = None
    tags: list[str] = pydantic.Field(default_factory=list, max_length=3)
    rating: float = pydantic.Field(gt=0, lt=5, description="stars")


def test_pydantic_models_are_not_refused():
    schema = Owner.model_json_schema()
    check_enforceable(schema)  # a discriminated oneOf, Optional, nested models, bounds
    assert grammar_accepts(schema, {"pet": {"kind": "cat", "lives": 3}, "nickname": None,
                                    "tags": [], "rating": 4.5})  # fmt: skip
    assert not grammar_accepts(schema, {"pet": {"kind": "cow", "lives": 3}, "rating": 4.5})


def test_forced_tool_calls_refuse_such_schemas_too():
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "not": {"const": ""}}},
        "required": ["q"]}}}]  # fmt: skip
    assert tool_call_constraint(tools, "auto") is None  # free text: no grammar, no refusal
    with pytest.raises(ValueError, match="uses 'not' at #/properties/q"):
        tool_call_constraint(tools, "required")


def test_the_engine_refuses_them_at_submission(default_llm):
    for keyword, schema, _ in BROKEN_TODAY[:5]:
        params = SamplingParams(max_tokens=4, structured_outputs=Structured(json=schema))
        with pytest.raises(ValueError, match=f"'{keyword}'"):
            default_llm.engine.add_request("hello", params)
    assert not core_of(default_llm).has_unfinished_requests()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 7,
              "minimum": 1, "maximum": 99}}, "required": ["n"]}  # fmt: skip
    out = default_llm.generate(
        "Reply with a JSON object holding a number.",
        SamplingParams(n=4, temperature=0.8, seed=5, max_tokens=20,
                       structured_outputs=Structured(json=schema)),
        use_tqdm=False,
    )[0]  # fmt: skip
    for sample in out.outputs:
        jsonschema.validate(json.loads(sample.text), schema)


def test_a_regex_with_lookaround_is_refused(default_llm):
    params = SamplingParams(max_tokens=4, structured_outputs=Structured(regex="(?!no)[a-z]+"))
    with pytest.raises(ValueError, match="lookahead or lookbehind"):
        default_llm.engine.add_request("hello", params)
    # Escaped or inside a class, the same characters are plain text: accepted.
    params = SamplingParams(max_tokens=4, structured_outputs=Structured(regex=r"\(\?=[(?!]"))
    default_llm.engine.add_request("hello", params).result()
