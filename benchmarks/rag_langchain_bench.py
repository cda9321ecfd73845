"""RAG chain over 20 questions with one long shared system prompt: prefix caching on vs off.

    python benchmarks/rag_langchain_bench.py [--questions 20] [--max-tokens 48]

The chain of examples/rag_langchain.py (retriever over examples/data, the shop's system
prompt, ChatPagedLLM on the embedded SmolLM2-135M-Instruct) answers the questions one
after another, as a user of a chat would ask them, on two engines that differ only in
enable_prefix_caching. Per call: prompt tokens, cache_read (prompt tokens served by the
prefix cache), time to first token and total time. Greedy decoding, so both engines must
give the same answers; the script checks it. Prints a table and writes
benchmarks/results/rag_langchain.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "rag_langchain.json"


def load_example():
    spec = importlib.util.spec_from_file_location(
        "rag_langchain_example", ROOT / "examples" / "rag_langchain.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(rag, retriever, questions: list[str], max_tokens: int, caching: bool) -> dict:
    from pagedllm_integrations.langchain import ChatPagedLLM

    chat = ChatPagedLLM(
        temperature=0,
        max_tokens=max_tokens,
        stop=["\n\n"],
        engine_kwargs={
            "max_model_len": 2048,
            "kv_cache_memory": 256 << 20,
            "enable_prefix_caching": caching,
            "disable_log_stats": True,
        },
    )
    chat.engine  # load the model before timing  # noqa: B018
    chain = rag.build_chain(chat, retriever)
    calls = []
    started = time.perf_counter()
    for question in questions:
        t0 = time.perf_counter()
        first = None
        full = None
        for chunk in chain.stream(question):
            if first is None and chunk.content:
                first = time.perf_counter() - t0
            full = chunk if full is None else full + chunk
        usage = full.usage_metadata
        calls.append(
            {
                "question": question,
                "answer": full.content,
                "input_tokens": usage["input_tokens"],
                "cache_read": usage["input_token_details"]["cache_read"],
                "output_tokens": usage["output_tokens"],
                "ttft_s": first,
                "latency_s": time.perf_counter() - t0,
            }
        )
    total = time.perf_counter() - started
    chat.close()  # the last holder: the engine and its memory go
    return {"prefix_caching": caching, "total_s": total, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    rag = load_example()
    retriever, retriever_name = rag.make_retriever()
    questions = rag.QUESTIONS[: args.questions]
    runs = {
        caching: run(rag, retriever, questions, args.max_tokens, caching)
        for caching in (False, True)
    }
    off, on = runs[False], runs[True]

    print(f"retriever: {retriever_name}; {len(questions)} questions, max_tokens {args.max_tokens}")
    print(
        f"{'#':>2} {'prompt':>6} {'cache_read':>10} {'ttft off':>9} {'ttft on':>8} "
        f"{'total off':>9} {'total on':>8}"
    )
    for i, (a, b) in enumerate(zip(off["calls"], on["calls"]), start=1):
        print(
            f"{i:>2} {b['input_tokens']:>6} {b['cache_read']:>10} {a['ttft_s'] or 0:>8.2f}s "
            f"{b['ttft_s'] or 0:>7.2f}s {a['latency_s']:>8.2f}s {b['latency_s']:>7.2f}s"
        )
    prompt = sum(c["input_tokens"] for c in on["calls"])
    cached = sum(c["cache_read"] for c in on["calls"])
    same = all(a["answer"] == b["answer"] for a, b in zip(off["calls"], on["calls"]))
    mean_ttft = {
        k: sum(c["ttft_s"] or 0 for c in r["calls"]) / len(questions) for k, r in runs.items()
    }
    summary = {
        "total_s_off": off["total_s"],
        "total_s_on": on["total_s"],
        "speedup": off["total_s"] / on["total_s"],
        "mean_ttft_s_off": mean_ttft[False],
        "mean_ttft_s_on": mean_ttft[True],
        "prompt_tokens": prompt,
        "cache_read_tokens": cached,
        "hit_rate": cached / max(prompt, 1),
        "cache_read_off": sum(c["cache_read"] for c in off["calls"]),
        "same_answers": same,
    }
    print(
        f"\ntotal: {off['total_s']:.1f}s without prefix caching, {on['total_s']:.1f}s with it "
        f"({summary['speedup']:.2f}x); mean time to first token {mean_ttft[False]:.2f}s -> "
        f"{mean_ttft[True]:.2f}s; {cached} of {prompt} prompt tokens "
        f"({100 * summary['hit_rate']:.1f}%) read from the cache; same answers: {same}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "retriever": retriever_name,
                "max_tokens": args.max_tokens,
                "summary": summary,
                "runs": [off, on],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
