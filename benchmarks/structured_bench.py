"""Constrained decoding cost: engine tokens/s with and without a grammar, and mask time.

Two parts:
  engine    32 requests x 128 tokens on the default model (greedy), once unconstrained
            (ignore_eos) and once under a JSON schema long enough that every request runs its
            full 128 tokens; reports tokens/s for each, and the time spent in the grammar
            (batched mask fill + apply per step, accept per token) per generated token.
  backends  xgrammar vs llguidance on the SmolLM2 tokenizer: tokenizer setup, compile time per
            schema, per-token mask time while walking a valid instance, whether the valid
            instance is accepted and an invalid one rejected (schema coverage), install size.
            llguidance is optional (skipped if absent); the engine uses xgrammar only.

Writes benchmarks/results/structured_bench.json.

    .venv/bin/python benchmarks/structured_bench.py [--part engine|backends|all]
        [--requests 32] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

RESULTS = Path(__file__).parent / "results" / "structured_bench.json"

# (schema, a valid instance, an instance that breaks the feature under test)
COVERAGE: dict[str, tuple[dict, object, object]] = {
    "nested objects": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                    "required": ["name", "age"],
                }
            },
            "required": ["user"],
        },
        {"user": {"name": "a", "age": 3}},
        {"user": {"name": "a"}},
    ),
    "array min/maxItems": (
        {
            "type": "object",
            "properties": {
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3}
            },
            "required": ["tags"],
        },
        {"tags": ["a", "b"]},
        {"tags": ["a", "b", "c", "d"]},
    ),
    "enum": (
        {"type": "object", "properties": {"c": {"enum": ["red", "green"]}}, "required": ["c"]},
        {"c": "red"},
        {"c": "blue"},
    ),
    "integer bounds": (
        {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["x"],
        },
        {"x": 7},
        {"x": 11},
    ),
    "number bounds": (
        {
            "type": "object",
            "properties": {"x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}},
            "required": ["x"],
        },
        {"x": 0.5},
        {"x": 2.5},
    ),
    "optional fields": (
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": False,
        },
        {"a": "x"},
        {"b": 1},
    ),
    "pattern string": (
        {
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
            "required": ["id"],
        },
        {"id": "ABC-12"},
        {"id": "abc-12"},
    ),
    "$ref/$defs": (
        {
            "$defs": {
                "pt": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                }
            },
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
            "required": ["a", "b"],
        },
        {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}},
        {"a": {"x": 1}, "b": {"x": 3, "y": 4}},
    ),
    "string min/maxLength": (
        {
            "type": "object",
            "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
            "required": ["s"],
        },
        {"s": "abc"},
        {"s": "abcdef"},
    ),
    "anyOf": (
        {
            "type": "object",
            "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
            "required": ["v"],
        },
        {"v": None},
        {"v": "s"},
    ),
    "format: date": (
        {
            "type": "object",
            "properties": {"d": {"type": "string", "format": "date"}},
            "required": ["d"],
        },
        {"d": "2024-01-31"},
        {"d": "yesterday"},
    ),
}

# Long enough that a request never finishes before --tokens: every step is masked.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 60,
            "maxItems": 60,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                },
                "required": ["name", "age"],
            },
        }
    },
    "required": ["people"],
}


def site_size(*names: str) -> float:
    """MiB on disk of the named site-packages folders."""
    import site

    total = 0
    for base in site.getsitepackages():
        for name in names:
            root = Path(base) / name
            if root.is_dir():
                total += sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return total / 2**20


# ------------------------------------------------------------------------ backends
def walk(fill, consume, ids: list[int], eos: int, vocab: int) -> tuple[bool, list[float]]:
    """Feed ids + EOS, checking each against the mask; (accepted, per-token mask seconds)."""
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for token in [*ids, eos]:
        started = time.perf_counter()
        fill(mask)
        times.append(time.perf_counter() - started)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1 or not consume(token):
            return False, times
    return True, times


def bench_backends(tokenizer, vocab: int) -> dict:
    eos = tokenizer.eos_token_id
    backends = {}

    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    xgr_setup = time.perf_counter() - started

    def xgr_compile(schema):
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":")
        )

    def xgr_matcher(compiled):
        matcher = xgr.GrammarMatcher(compiled)
        return (lambda mask: matcher.fill_next_token_bitmask(mask, 0)), matcher.accept_token

    backends["xgrammar"] = (xgr_setup, xgr_compile, xgr_matcher, ("xgrammar", "tvm_ffi"))
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        print("llguidance not installed: compared against nothing")
    else:
        started = time.perf_counter()
        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        llg_setup = time.perf_counter() - started

        def llg_compile(schema):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
            error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
            if error:
                raise ValueError(error)
            llguidance.LLMatcher(lltok, grammar)  # builds the parser: part of compiling
            return grammar

        def llg_matcher(grammar):
            matcher = llguidance.LLMatcher(lltok, grammar)

            def fill(mask):
                llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)

            def consume(token):
                return matcher.consume_token(token) and not matcher.is_error()

            return fill, consume

        backends["llguidance"] = (llg_setup, llg_compile, llg_matcher, ("llguidance",))

    report = {}
    for name, (setup, compile_, new_matcher, folders) in backends.items():
        rows, all_times = {}, []
        for feature, (schema, good, bad) in COVERAGE.items():
            started = time.perf_counter()
            compiled = compile_(schema)
            compile_ms = (time.perf_counter() - started) * 1e3
            good_ids = tokenizer.encode(
                json.dumps(good, separators=(",", ":")), add_special_tokens=False
            )
            bad_ids = tokenizer.encode(
                json.dumps(bad, separators=(",", ":")), add_special_tokens=False
            )
            accepted, times = walk(*new_matcher(compiled), good_ids, eos, vocab)
            rejected = not walk(*new_matcher(compiled), bad_ids, eos, vocab)[0]
            all_times += times
            rows[feature] = {
                "compile_ms": round(compile_ms, 2),
                "mask_us_mean": round(statistics.mean(times) * 1e6, 1),
                "enforced": accepted and rejected,
            }
        all_times.sort()
        report[name] = {
            "tokenizer_setup_ms": round(setup * 1e3, 1),
            "install_mib": round(site_size(*folders), 1),
            "mask_us_mean": round(statistics.mean(all_times) * 1e6, 1),
            "mask_us_p50": round(all_times[len(all_times) // 2] * 1e6, 1),
            "mask_us_p99": round(all_times[int(len(all_times) * 0.99)] * 1e6, 1),
            "features": rows,
        }
    print(f"\n{'feature':22s}" + "".join(f"{n:>34s}" for n in report))
    for feature in COVERAGE:
        cells = []
        for name in report:
            row = report[name]["features"][feature]
            cells.append(
                f"{'ok' if row['enforced'] else 'NOT ENFORCED':>13s} {row['compile_ms']:7.1f} ms "
                f"{row['mask_us_mean']:6.0f} us"
            )
        print(f"{feature:22s}" + "".join(f"{c:>34s}" for c in cells))
    for name, r in report.items():
        print(
            f"{name}: tokenizer setup {r['tokenizer_setup_ms']:.0f} ms, mask per token mean "
            f"{r['mask_us_mean']:.0f} us / p50 {r['mask_us_p50']:.0f} us / p99 "
            f"{r['mask_us_p99']:.0f} us, install {r['install_mib']:.1f} MiB"
        )
    return report


# -------------------------------------------------------------------------- engine
class GrammarTimer:
    """Accumulates the time the engine spends in grammar code (wraps the module functions)."""

    def __init__(self):
        from pagedllm_integrations.engine import structured_outputs as so

        self.module = so
        self.mask_s = 0.0
        self.accept_s = 0.0
        self.rows = 0
        self._apply = so.apply_grammar_masks
        self._accept = so.GrammarMatcher.accept_token

    def __enter__(self):
        timer = self

        def apply(logits, rows, matchers):
            started = time.perf_counter()
            timer._apply(logits, rows, matchers)
            timer.mask_s += time.perf_counter() - started
            timer.rows += len(rows)

        def accept(matcher, token):
            started = time.perf_counter()
            ok = timer._accept(matcher, token)
            timer.accept_s += time.perf_counter() - started
            return ok

        self.module.apply_grammar_masks = apply
        self.module.GrammarMatcher.accept_token = accept
        return self

    def __exit__(self, *exc):
        self.module.apply_grammar_masks = self._apply
        self.module.GrammarMatcher.accept_token = self._accept


def bench_engine(num_requests: int, num_tokens: int) -> dict:
    from pagedllm_integrations import LLM, SamplingParams
    from pagedllm_integrations.engine.sampling_params import StructuredOutputsParams

    llm = LLM(disable_log_stats=True, max_model_len=2048, max_num_seqs=num_requests)
    tokenizer = llm.get_tokenizer()
    topics = ["people", "cities", "books", "films", "rivers", "birds", "cars", "songs"]
    prompts = []
    for i in range(num_requests):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"List {topics[i % 8]} #{i} as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompts.append({"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
    free = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0,
        max_tokens=num_tokens,
        structured_outputs=StructuredOutputsParams(json=LONG_SCHEMA),
    )
    llm.generate(prompts[:2], free.clone(max_tokens=4), use_tqdm=False)  # warm up
    llm.generate(prompts[:2], constrained.clone(max_tokens=4), use_tqdm=False)  # compiles
    report = {}
    for name, params in (("unconstrained", free), ("json_schema", constrained)):
        with GrammarTimer() as timer:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
        tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
        report[name] = {
            "requests": num_requests,
            "generated_tokens": tokens,
            "seconds": round(elapsed, 2),
            "tokens_per_s": round(tokens / elapsed, 1),
            "grammar_mask_us_per_token": round(timer.mask_s / max(timer.rows, 1) * 1e6, 1),
            "grammar_accept_us_per_token": round(timer.accept_s / max(tokens, 1) * 1e6, 1),
            "grammar_share_of_time": round((timer.mask_s + timer.accept_s) / elapsed, 4),
        }
        print(
            f"{name:14s} {tokens} tokens in {elapsed:.1f} s = {tokens / elapsed:.1f} tok/s; "
            f"grammar mask {report[name]['grammar_mask_us_per_token']} us/token, accept "
            f"{report[name]['grammar_accept_us_per_token']} us/token, "
            f"{report[name]['grammar_share_of_time']:.2%} of the time"
        )
    llm.shutdown()
    report["slowdown"] = round(
        report["unconstrained"]["tokens_per_s"] / report["json_schema"]["tokens_per_s"], 3
    )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["engine", "backends", "all"], default="all")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    results: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
    }
    if args.part in ("backends", "all"):
        import transformers

        from pagedllm_integrations.engine.model_loader import default_model_path, gguf_to_hf_folder

        tokenizer = transformers.AutoTokenizer.from_pretrained(
            gguf_to_hf_folder(default_model_path())
        )
        results["backends"] = bench_backends(tokenizer, 49152)
    if args.part in ("engine", "all"):
        results["engine"] = bench_engine(args.requests, args.tokens)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    previous.update(results)
    RESULTS.write_text(json.dumps(previous, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
