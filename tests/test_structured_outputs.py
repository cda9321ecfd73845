"""Constrained decoding on the default model: every output must satisfy its constraint."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine.sampling_params import StructuredOutputsParams as Structured
from pagedllm_integrations.engine.white_box import core_of

NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS: list[dict] = [
    # 1 flat object
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    # 2 nested objects
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    # 3 array of strings with min/max items
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
    },
    # 4 enum
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3]}},
        "required": ["color", "shade"],
    },
    # 5 numbers with bounds (integer, number, exclusive)
    {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60},
        },
        "required": ["count", "ratio", "temp"],
    },
    # 6 optional fields, no extra properties
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "subtitle": NAME,
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    # 7 booleans and null
    {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "note": {"type": "null"}},
        "required": ["done", "note"],
    },
    # 8 array of objects
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": NAME,
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["items"],
    },
    # 9 pattern strings
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
        },
        "required": ["code", "email"],
    },
    # 10 $defs / $ref
    {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -100, "maximum": 100},
                    "y": {"type": "integer", "minimum": -100, "maximum": 100},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    # 11 anyOf
    {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, NAME]}},
        "required": ["value"],
    },
    # 12 const and enum of mixed types
    {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "level": {"enum": ["low", 2, True, None]}},
        "required": ["version", "level"],
    },
    # 13 top-level array
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 3,
        "maxItems": 5,
    },
    # 14 string length bounds
    {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 8}},
        "required": ["word"],
    },
    # 15 date format and a time pattern
    {
        "type": "object",
        "properties": {
            "day": {"type": "string", "format": "date"},
            "at": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
        },
        "required": ["day", "at"],
    },
    # 16 nested arrays
    {
        "type": "object",
        "properties": {
            "grid": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["grid"],
    },
    # 17 all optional
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": NAME},
    },
    # 18 array of enums, unique
    {
        "type": "object",
        "properties": {
            "days": {
                "type": "array",
                "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["days"],
    },
    # 19 deep nesting with an optional object
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "customer": {
                        "type": "object",
                        "properties": {"name": NAME, "vip": {"type": "boolean"}},
                        "required": ["name"],
                    },
                    "total": {"type": "number", "minimum": 0, "maximum": 10000},
                },
                "required": ["id", "customer", "total"],
            }
        },
        "required": ["order"],
    },
    # 20 oneOf-like discriminated union
    {
        "type": "object",
        "properties": {
            "shape": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "circle"},
                            "r": {"type": "integer", "minimum": 1, "maximum": 50},
                        },
                        "required": ["kind", "r"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "kind": {"const": "square"},
                            "side": {"type": "integer", "minimum": 1, "maximum": 50},
                        },
                        "required": ["kind", "side"],
                    },
                ]
            }
        },
        "required": ["shape"],
    },
]
assert len(SCHEMAS) == 20


def chat_ids(llm, text: str) -> dict:
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {"prompt_token_ids": tokenizer(prompt, add_special_tokens=False).input_ids}


def schema_prompt(llm, schema: dict) -> dict:
    return chat_ids(
        llm, f"Reply with one JSON value matching this JSON schema:\n{json.dumps(schema)}"
    )


def run_schemas(llm, generations: int) -> float:
    """All 20 schemas, `generations` samples each, submitted as one batch; returns seconds."""
    prompts = [schema_prompt(llm, schema) for schema in SCHEMAS]
    params = [
        SamplingParams(
            n=generations,
            temperature=0.8,
            seed=100 + i,
            max_tokens=160,
            structured_outputs=Structured(json=schema),
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    for schema, output in zip(SCHEMAS, outputs):
        assert len(output.outputs) == generations
        for sample in output.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)
    return elapsed


def test_twenty_schemas_four_generations_each(default_llm):
    run_schemas(default_llm, 4)


@pytest.mark.slow
def test_twenty_schemas_twenty_generations_each(default_llm):
    run_schemas(default_llm, 20)


REGEXES = [r"[A-Z][a-z]{2,8}-[0-9]{3}", r"(yes|no|maybe), because [a-z ]{5,20}\.", r"#[0-9a-f]{6}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Rome", "Berlin"]]


def test_regex_choice_and_json_object(default_llm):
    llm = default_llm
    prompts, params, checks = [], [], []
    for i, pattern in enumerate(REGEXES):
        prompts.append(chat_ids(llm, f"Write a string matching the regex {pattern}"))
        params.append(
            SamplingParams(
                n=8,
                temperature=0.8,
                seed=i,
                max_tokens=40,
                structured_outputs=Structured(regex=pattern),
            )
        )
        checks.append(lambda text, p=pattern: re.fullmatch(p, text) is not None)
    for i, options in enumerate(CHOICES):
        prompts.append(chat_ids(llm, f"Pick one of {options}."))
        params.append(
            SamplingParams(
                n=8,
                temperature=0.8,
                seed=10 + i,
                max_tokens=10,
                structured_outputs=Structured(choice=options),
            )
        )
        checks.append(lambda text, o=options: text in o)
    # Free-form JSON has no length bound and this small model, sampled (or greedy on some
    # prompts, such as describing the weather, or the capital of France on the fast path),
    # can nest or repeat past any budget; greedy on prompts it answers briefly on both the
    # fast path and the float32 path.
    for request in (
        "Return a JSON object with a person's name and age.",
        "Give the boiling point of water in Celsius as JSON.",
        "Return a JSON object with a city's name and country.",
    ):
        prompts.append(chat_ids(llm, request))
        params.append(
            SamplingParams(
                temperature=0, max_tokens=160, structured_outputs=Structured(json_object=True)
            )
        )
        checks.append(lambda text: isinstance(json.loads(text), dict))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for check, output in zip(checks, outputs):
        for sample in output.outputs:
            assert sample.finish_reason == "stop" and check(sample.text), sample.text
    # The choice outputs are not all the same: the mask leaves the model its own preferences.
    assert len({s.text for s in outputs[len(REGEXES)].outputs}) > 1


def test_pydantic_model_as_schema(default_llm):
    pydantic = pytest.importorskip("pydantic")

    class Pet(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        legs: int = pydantic.Field(ge=0, le=8)

    spec = Structured(json=Pet)
    assert spec.json == Pet.model_json_schema()
    out = default_llm.generate(
        [schema_prompt(default_llm, spec.json)],
        SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=60, structured_outputs=spec),
        use_tqdm=False,
    )[0]
    for sample in out.outputs:
        Pet.model_validate_json(sample.text)


@pytest.mark.parametrize(
    "spec",
    [
        dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        dict(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        dict(json='{"type": "object", '),
        dict(regex="([a-z]+"),
        dict(grammar='root ::= "a" undefined_rule'),
        dict(grammar="start: ( unbalanced"),
    ],
)
def test_bad_constraint_is_a_value_error_at_submission(default_llm, spec):
    with pytest.raises(ValueError):  # SamplingParams, or add_request on the caller's thread
        params = SamplingParams(max_tokens=4, structured_outputs=Structured(**spec))
        default_llm.engine.add_request("hello", params)
    assert not core_of(default_llm).has_unfinished_requests()


def test_grammar_and_lark(default_llm):
    ebnf = 'root ::= "The answer is " [0-9] [0-9]? "."'
    lark = 'start: "Colour: " COLOUR "!"\nCOLOUR: "red" | "green" | "blue"'
    outs = default_llm.generate(
        [chat_ids(default_llm, "What is 6 times 7?"), chat_ids(default_llm, "Name a colour.")],
        [
            SamplingParams(
                n=4,
                temperature=0.8,
                seed=1,
                max_tokens=16,
                structured_outputs=Structured(grammar=ebnf),
            ),
            SamplingParams(
                n=4,
                temperature=0.8,
                seed=2,
                max_tokens=16,
                structured_outputs=Structured(grammar=lark),
            ),
        ],
        use_tqdm=False,
    )
    for sample in outs[0].outputs:
        assert re.fullmatch(r"The answer is [0-9][0-9]?\.", sample.text), sample.text
    for sample in outs[1].outputs:
        assert re.fullmatch(r"Colour: (red|green|blue)!", sample.text), sample.text


def test_mixed_batch_leaves_unconstrained_rows_exact(default_llm):
    llm = default_llm
    free = [
        chat_ids(llm, q)
        for q in ("Name three fruits.", "What is the capital of France?", "Say hi.")
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    solo = [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in free]
    constrained = [schema_prompt(llm, SCHEMAS[i]) for i in (0, 3, 9)]
    mixed_params = [greedy] * 3 + [
        SamplingParams(
            n=2,
            temperature=0.8,
            seed=i,
            max_tokens=60,
            structured_outputs=Structured(json=SCHEMAS[k]),
        )
        for i, k in enumerate((0, 3, 9))
    ]
    before = llm.engine.counters.snapshot()["max_seqs_in_step"]
    outs = llm.generate(free + constrained, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3]] == solo
    for k, out in zip((0, 3, 9), outs[3:]):
        for sample in out.outputs:
            jsonschema.validate(json.loads(sample.text), SCHEMAS[k])
    assert llm.engine.counters.snapshot()["max_seqs_in_step"] >= max(before, 9)


# ------------------------------------------------------------ masks, no model needed
@pytest.fixture(scope="module")
def manager(default_model_folder):
    import transformers

    from pagedllm_integrations.engine.structured_outputs import StructuredOutputManager

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_folder)
    # A model vocabulary wider than the tokenizer's, as padded embedding tables are.
    return tokenizer, StructuredOutputManager(tokenizer, len(tokenizer) + 64, stop_token_ids=[2])


def test_mask_allows_exactly_the_grammar_prefixes(manager):
    from pagedllm_integrations.engine.structured_outputs import apply_grammar_masks

    tokenizer, mgr = manager
    width = len(tokenizer) + 64
    compiled = mgr.compile(Structured(choice=["yes", "no"]))
    assert mgr.compile(Structured(choice=["yes", "no"])) is compiled  # cached
    a, b = mgr.new_matcher(compiled), mgr.new_matcher(compiled)
    logits = torch.zeros(3, width)
    apply_grammar_masks(logits, [0, 2], [a, b])
    assert bool((logits[1] == 0).all())  # an unconstrained row is untouched
    allowed = set((logits[0] == 0).nonzero().flatten().tolist())
    assert allowed == set((logits[2] == 0).nonzero().flatten().tolist())
    # The reference: every token whose text is a non-empty prefix of "yes" or "no".
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    expected = {
        i
        for i, piece in enumerate(vocab)
        if i not in tokenizer.all_special_ids
        and tokenizer.convert_tokens_to_string([piece])
        and any(w.startswith(tokenizer.convert_tokens_to_string([piece])) for w in ("yes", "no"))
    }
    assert allowed == expected
    assert 2 not in allowed and not allowed & set(range(len(tokenizer), width))
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert a.accept_token(token) and not a.is_terminated()
    logits = torch.zeros(1, width)
    a.mask_logits(logits[0])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [2]  # only EOS once complete
    assert a.accept_token(2) and a.is_terminated()
    assert not b.accept_token(tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert not b.accept_token(tokenizer.encode("no", add_special_tokens=False)[0])  # stays failed


def test_compile_cache_is_thread_safe(manager):
    from concurrent.futures import ThreadPoolExecutor

    _, mgr = manager
    specs = [
        Structured(json={"type": "object", "properties": {f"k{i % 4}": {"type": "integer"}}})
        for i in range(32)
    ]
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(mgr.compile, specs))
    for i, c in enumerate(compiled):
        assert c is compiled[i % 4]
