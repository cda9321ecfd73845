"""Token counts of a conversation that add up, for LangChain's `trim_messages` and friends.

A count is the tokens of what the chat template renders for exactly the messages given,
plus the generation prompt a call appends. Some templates (SmolLM2's, Qwen2.5's) add a
default system prompt when the first message is not a system message; counting that for
every subset made the counts of parts not add up: `trim_messages` counts the system message
alone and then the other messages without it, so every count of the others carried the
default system prompt, and a 37-token conversation trimmed to 45 kept only the system
message. Here the default system prompt is never counted, so

    count([system]) + count(rest) == count([system, *rest]) + generation prompt

for templates that render each turn on its own (ChatML, Llama 3, Qwen, Phi-3). Templates
that fold the system message into another turn (Gemma, Mistral) are counted as rendered.
A conversation that starts with a system message counts exactly the prompt tokens a call
reports (`usage.input_tokens`); one without counts the tokens of its own turns, and a call
adds the template's default system prompt, if it has one.
"""

from __future__ import annotations

from ..engine.client import EngineClient
from .errors import ChatRequestError
from .prepare import prompt_token_ids, render_chat
from .special_tokens import ContentGuard
from .tool_choice import plan_tools
from .tool_formats import model_tool_format

# A system message put in front of a conversation that has none, so that the template adds
# no default system prompt; its own tokens are subtracted again.
_PROBE = "pagedllm token count probe"


def count_chat_tokens(client: EngineClient, messages: list[dict], tools: list | None = None) -> int:
    """Tokens the conversation takes as a prompt: its turns as the template renders them,
    the tools described in it, and the generation prompt; never the template's default
    system prompt (see the module docstring). An empty conversation counts 0."""
    if not messages:
        return 0
    plan = plan_tools(tools, tool_format=model_tool_format(client))
    guard = ContentGuard(client.tokenizer)
    marked = guard.mark_messages(messages)
    marked_tools = guard.mark_value(plan.tools) if plan.tools else plan.tools

    def tokens(conversation: list[dict], add_generation_prompt: bool = True) -> tuple[str, int]:
        text = render_chat(
            client,
            conversation,
            marked_tools,
            plan.tool_choice,
            add_generation_prompt=add_generation_prompt,
        )
        return text, len(prompt_token_ids(client, text, guard))

    # With tools the template describes them in the system turn, which is then counted as a
    # call with these tools sends it.
    if messages[0].get("role") == "system" or plan.tools:
        return tokens(marked)[1]
    probe = [{"role": "system", "content": _PROBE}]
    try:
        base_text, base = tokens(probe, add_generation_prompt=False)
        full_text, full = tokens(probe + marked)
    except ChatRequestError:  # the template takes no system message, or not in front
        return tokens(marked)[1]
    if _PROBE not in base_text or not full_text.startswith(base_text):
        # The template folds the system message into a later turn: no turn of its own.
        return tokens(marked)[1]
    return full - base
