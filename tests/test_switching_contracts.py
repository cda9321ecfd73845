"""What a switching user relies on beyond the constructor (issue 44), on the default model:
token counts that add up (trim_messages keeps what fits), a wrapper's own settings over a
wrapped object's, LlamaIndex complete() through the chat template, tools and structured
output refused where LangChain would drop the tools, one engine for settings that cannot
change it, and errors that name the user's setting. (FunctionAgent's initial_tool_choice
and predict_and_call's tool_required: tests/test_llama_index.py.)"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
from langchain_core.tools import tool
from pydantic import BaseModel

from pagedllm_integrations import peer_settings
from pagedllm_integrations.engine.model_loader import default_model_path
from pagedllm_integrations.engine.sampling_params import RequestOutputKind
from pagedllm_integrations.langchain import ChatPagedLLM, PagedLLM
from pagedllm_integrations.langchain_messages import to_openai_messages
from pagedllm_integrations.llama_index import PagedLlamaIndexLLM

DEFAULT = str(default_model_path())
SMALL = {"kv_cache_memory": 160 << 20, "max_model_len": 2048}
# What SmolLM2's chat template writes in front of a conversation without a system message.
SMOL_DEFAULT_SYSTEM = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n"
)


@pytest.fixture(scope="module")
def chat():
    model = ChatPagedLLM(model=DEFAULT, temperature=0, engine_kwargs=SMALL)
    yield model
    model.close()


def rendered_length(tokenizer, messages) -> int:
    """The reference: the prompt tokens of `messages` as transformers renders SmolLM2's
    template, without the default system prompt it adds to a conversation without one."""
    text = tokenizer.apply_chat_template(
        to_openai_messages(messages), tokenize=False, add_generation_prompt=True
    )
    if not isinstance(messages[0], SystemMessage):
        assert text.startswith(SMOL_DEFAULT_SYSTEM)
        text = text[len(SMOL_DEFAULT_SYSTEM) :]
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def template_tokens(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> int:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def generation_prompt_length(tokenizer) -> int:
    one = [{"role": "system", "content": "x"}]
    return template_tokens(tokenizer, one) - template_tokens(tokenizer, one, False)


# ------------------------------------------------------------------- token counts
def test_counts_of_parts_add_up(chat):
    tokenizer = chat.engine.tokenizer
    system, rest = SystemMessage("You are terse."), [
        HumanMessage("Hi there"), AIMessage("Hello! How can I help?"), HumanMessage("2+2?")
    ]  # fmt: skip
    count = chat.get_num_tokens_from_messages
    for part in ([system, *rest], rest, rest[1:], rest[::-1]):
        assert count(part) == rendered_length(tokenizer, part)
    # The generation prompt is in each count once: the sum of parts holds it twice.
    generation = generation_prompt_length(tokenizer)
    assert count([system]) + count(rest) == count([system, *rest]) + generation
    # With a system message the count is what a call reports as its input.
    reply = chat.invoke([system, *rest], max_tokens=1)
    assert reply.usage_metadata["input_tokens"] == count([system, *rest])
    assert count([]) == 0


@pytest.mark.parametrize(
    "strategy, include_system, start_on",
    [("last", True, None), ("last", True, "human"), ("last", False, None), ("first", False, None)],
)
def test_trim_messages_keeps_what_fits(chat, strategy, include_system, start_on):
    tokenizer = chat.engine.tokenizer
    turns = [SystemMessage("You answer in one short sentence.")]
    for i in range(6):
        turns += [HumanMessage(f"Question {i}: what is {i} plus {i}?"),
                  AIMessage(f"{i} plus {i} is {2 * i}.")]  # fmt: skip
    turns.append(HumanMessage("And 7 plus 7?"))
    if not include_system:
        turns = turns[1:]
    # trim_messages adds the system message's count to the others': the generation prompt
    # is then counted twice, the only slack there is.
    slack = generation_prompt_length(tokenizer) if include_system else 0
    everything = chat.get_num_tokens_from_messages(turns)
    for budget in (everything, everything - 1, 45, 80, 120):
        kept = trim_messages(turns, max_tokens=budget, token_counter=chat, strategy=strategy,
                             include_system=include_system, start_on=start_on)  # fmt: skip
        assert kept, budget
        assert rendered_length(tokenizer, kept) <= budget
        if len(kept) == len(turns):
            continue
        # The next message it left out would not have fitted.
        if strategy == "last":
            position = turns.index(kept[1] if include_system else kept[0])
            longer = [*kept[:1], turns[position - 1], *kept[1:]] if include_system else [
                turns[position - 1], *kept
            ]  # fmt: skip
        else:
            longer = turns[: len(kept) + 1]
        if start_on is None:
            assert rendered_length(tokenizer, longer) > budget - slack


def test_the_issue_conversation_is_kept_whole(chat):
    """Issue 44's case: a 37-token conversation trimmed to 45 kept only its system message."""
    turns = [SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello!"),
             HumanMessage("Name a colour.")]  # fmt: skip
    assert chat.get_num_tokens_from_messages(turns) <= 45
    kept = trim_messages(turns, max_tokens=45, token_counter=chat, strategy="last",
                         include_system=True)  # fmt: skip
    assert kept == turns


# ------------------------------------------------------------- settings precedence
def test_the_chat_models_own_settings_win_over_the_wrapped_llms():
    llm = PagedLLM(model=DEFAULT, max_new_tokens=64, temperature=0.9, top_k=7,
                   engine_kwargs=SMALL)  # fmt: skip
    chat = ChatPagedLLM(llm=llm, max_tokens=5, temperature=0)  # the ChatHuggingFace stand-in
    try:
        assert (chat.max_tokens, chat.temperature, chat.top_k) == (5, 0, 7)
        params = chat._prepare([HumanMessage("Hi")], None, {}, RequestOutputKind.FINAL_ONLY)[2]
        assert (params.params.max_tokens, params.params.temperature) == (5, 0)
        reply = chat.invoke("Write a long story about a dragon.")
        assert reply.usage_metadata["output_tokens"] == 5  # not the llm's 64
        assert chat.engine is llm.engine
        # Without its own, the chat model takes the llm's; another model is a contradiction.
        assert ChatPagedLLM(llm=llm).max_tokens == 64
        with pytest.raises(ValueError, match="'model' is given twice"):
            ChatPagedLLM(llm=llm, model="other.gguf")
    finally:
        chat.close()
        llm.close()


# -------------------------------------------------------- LlamaIndex complete()
def test_llama_index_complete_goes_through_the_chat_template():
    from llama_index.core.base.llms.types import ChatMessage

    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as Ollama

    llm = Ollama(model=DEFAULT, request_timeout=60.0, temperature=0, max_new_tokens=40,
                 engine_kwargs=SMALL)  # fmt: skip
    try:
        prompt = "Write three sentences about cats."
        response = llm.complete(prompt)
        assert response.text.strip()  # issue 44: the raw prompt gave ''
        chat = llm.chat([ChatMessage(role="user", content=prompt)])
        assert response.text == chat.message.content
        tokenizer = llm.engine.tokenizer
        rendered = template_tokens(tokenizer, [{"role": "user", "content": prompt}])
        assert response.raw["usage"]["prompt_tokens"] == rendered
        streamed = "".join(c.delta for c in llm.stream_complete(prompt))
        assert streamed == response.text
        # is_chat_model=False (LlamaIndex Vllm's default): the prompt as it is.
        raw = llm.model_copy(update={"is_chat_model": False}).complete(prompt)
        assert raw.raw["usage"]["prompt_tokens"] == len(tokenizer(prompt).input_ids)
    finally:
        llm.close()


# --------------------------------------------------- tools and structured output
@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


class City(BaseModel):
    name: str


def test_bind_tools_then_with_structured_output_is_refused(chat):
    bound = chat.bind_tools([get_weather], tool_choice="any")
    with pytest.raises(ValueError, match="would drop the bound tools"):
        bound.with_structured_output(City)
    with pytest.raises(ValueError, match="would drop the bound tools"):
        bound.bind(stop=["\n"]).with_structured_output(City)
    # No tools bound: nothing to drop.
    assert chat.bind_tools([]).with_structured_output(City) is not None
    city = chat.with_structured_output(City).invoke("Paris is a city. Extract the city.")
    assert isinstance(city, City)


# ----------------------------------------------------------------- one engine
def test_settings_that_cannot_change_the_engine_share_it():
    import torch

    chat = ChatPagedLLM(model=DEFAULT, engine_kwargs=SMALL)
    vllm = PagedLLM(model=DEFAULT, trust_remote_code=True, engine_kwargs=SMALL)
    index = PagedLlamaIndexLLM(model=DEFAULT, trust_remote_code=True,
                               engine_kwargs={**SMALL, "enforce_eager": False})  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pinned = ChatPagedLLM(model=DEFAULT, engine_kwargs={**SMALL, "device": device})
    try:
        assert vllm.engine is chat.engine is index.engine is pinned.engine
    finally:
        for wrapper in (chat, vllm, index, pinned):
            wrapper.close()


# -------------------------------------------------------- notes and error names
def test_api_key_and_max_retries_are_noted_without_the_key(caplog, monkeypatch):
    monkeypatch.setattr(peer_settings, "_noted", set())
    with caplog.at_level(logging.WARNING, logger="pagedllm_integrations.peer_settings"):
        ChatPagedLLM(api_key="sk-secret-123", max_retries=2)
    assert "api_key" in caplog.text and "in this process" in caplog.text
    assert "max_retries" in caplog.text and "sk-secret-123" not in caplog.text


def test_context_length_errors_name_the_users_setting():
    from pagedllm_integrations.langchain import ChatPagedLLM as ChatOllama
    from pagedllm_integrations.llama_index import PagedLlamaIndexLLM as Ollama

    with pytest.raises(ValueError, match=r"^num_ctx=10000 exceeds the model's context length 8192"):
        ChatOllama(model=DEFAULT, num_ctx=10000).invoke("Hi")
    with pytest.raises(ValueError, match=r"^context_window=9000 exceeds"):
        Ollama(model=DEFAULT, context_window=9000).complete("Hi")
    with pytest.raises(ValueError, match=r"^additional_kwargs\['num_ctx'\]=9999 exceeds"):
        Ollama(model=DEFAULT, additional_kwargs={"num_ctx": 9999}).complete("Hi")
    with pytest.raises(ValueError, match=r"^max_model_len 9000 exceeds"):  # the user's name
        ChatPagedLLM(model=DEFAULT, engine_kwargs={"max_model_len": 9000}).invoke("Hi")


def test_num_threads_is_refused_where_torchs_threads_do_the_work():
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU num_threads is noted, not refused")
    reference = ChatPagedLLM(model=DEFAULT, n_threads=1,
                             engine_kwargs={**SMALL, "dtype": "float32"})  # fmt: skip
    with pytest.raises(ValueError, match="num_threads=1 sets the threads of the CPU fast path"):
        reference.invoke("Hi")
