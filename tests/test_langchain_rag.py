"""RAG and agents with ChatPagedLLM on the embedded default model.

A retrieval chain with a long shared system prompt reads that prompt from the prefix cache
from its second call on (reported as usage_metadata input_token_details.cache_read), and a
LangGraph ReAct agent calls a Python tool and answers with the tool's result.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from pagedllm_integrations.langchain import ChatPagedLLM

ENGINE = {"max_model_len": 2048, "kv_cache_memory": 256 << 20}
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rag_langchain.py"


@pytest.fixture(scope="module")
def rag():
    """The RAG example's module: documents, retrievers, system prompt, chain builder."""
    spec = importlib.util.spec_from_file_location("rag_langchain_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the retriever's annotations here
    spec.loader.exec_module(module)
    return module


def test_bm25_retriever_finds_the_page_that_answers(rag) -> None:
    retriever = rag.BM25Retriever(documents=rag.load_documents(), k=1)
    (hit,) = retriever.invoke("How much does replacing an inner tube cost?")
    assert hit.metadata["source"] == "repairs.md"
    (hit,) = retriever.invoke("What is the deposit for renting a bike?")
    assert hit.metadata["source"] == "rentals.md"


def test_rag_chain_reads_the_shared_system_prompt_from_the_prefix_cache(rag) -> None:
    retriever, _ = rag.make_retriever(k=2)
    chat = ChatPagedLLM(temperature=0, max_tokens=24, stop=["\n\n"], engine_kwargs=ENGINE)
    engine = chat.engine
    assert engine.reset_prefix_cache()  # start cold: nothing else shares our prefix
    system_tokens = len(
        engine.tokenizer(
            engine.apply_chat_template(
                [{"role": "system", "content": rag.SYSTEM_PROMPT}], add_generation_prompt=False
            ),
            add_special_tokens=False,
        ).input_ids
    )
    assert system_tokens > 300  # long enough to be worth caching
    block = engine.config.block_size
    chain = rag.build_chain(chat, retriever)
    questions = rag.QUESTIONS[:3]
    usages = []
    for question in questions:
        message = chain.invoke(question)
        assert isinstance(message, AIMessage) and message.content.strip()
        usages.append(message.usage_metadata)
    reads = [u["input_token_details"]["cache_read"] for u in usages]
    assert reads[0] == 0
    for usage, read in zip(usages[1:], reads[1:]):
        # Every full block of the system prompt came from the cache (the template's first
        # tokens and the system prompt are identical across questions).
        assert read >= (system_tokens // block) * block, reads
        assert read < usage["input_tokens"]

    # Streaming reports the same usage, on its last chunk only.
    full = None
    chunks = 0
    for chunk in chain.stream(questions[1]):
        chunks += 1
        full = chunk if full is None else full + chunk
    assert chunks > 2
    assert full.usage_metadata["input_tokens"] == usages[1]["input_tokens"]
    assert full.usage_metadata["output_tokens"] == usages[1]["output_tokens"]
    assert full.usage_metadata["input_token_details"]["cache_read"] >= reads[1]
    assert full.content == chain.invoke(questions[1]).content


def test_rag_answer_copies_the_retrieved_fact(rag) -> None:
    retriever, _ = rag.make_retriever(k=2)
    chat = ChatPagedLLM(temperature=0, max_tokens=24, stop=["\n\n"], engine_kwargs=ENGINE)
    answer = rag.build_chain(chat, retriever).invoke("How much does a basic service cost?")
    assert "45" in answer.content


def test_react_agent_calls_a_python_tool_and_returns_its_answer() -> None:
    prebuilt = pytest.importorskip("langgraph.prebuilt")
    calls: list[tuple[int, int]] = []

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        calls.append((a, b))
        return a + b

    chat = ChatPagedLLM(temperature=0, max_tokens=48, stop=["\n\n"], engine_kwargs=ENGINE)

    def model_for(state, runtime):
        # Force a call on the user's turn; after the tool result, answer in text. A 135M
        # model does not decide to call tools by itself (tool_choice="auto").
        last = state["messages"][-1]
        return chat.bind_tools(
            [add], tool_choice="any" if isinstance(last, HumanMessage) else "none"
        )

    agent = prebuilt.create_react_agent(model_for, [add])
    result = agent.invoke({"messages": [HumanMessage("What is 25 plus 17?")]})
    messages = result["messages"]
    call_message = next(m for m in messages if isinstance(m, AIMessage) and m.tool_calls)
    assert call_message.tool_calls[0]["name"] == "add"
    assert len(calls) == 1
    tool_message = next(m for m in messages if isinstance(m, ToolMessage))
    assert tool_message.content == str(sum(calls[0]))
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert tool_message.content in final.content
