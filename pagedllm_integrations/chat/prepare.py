"""A chat request, prepared: the conversation rendered by the model's chat template (tools
described in it), tokenized, and its sampling settings with the tool plan's constraint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.client import EngineClient
from ..engine.request_limits import check_text
from ..engine.sampling_params import SamplingParams, StructuredOutputsParams
from .chat_messages import content_text
from .errors import ChatRequestError
from .special_tokens import ContentGuard
from .template_sandbox import SandboxedTemplate, TemplateRenderError
from .tool_calls import render_chat_prompt
from .tool_choice import ToolPlan, plan_tools
from .tool_formats import model_tool_format

_MAX_ERROR_CHARS = 500


@dataclass(slots=True)
class ChatOptions:
    """A chat call's tools and structure (OpenAI's names, which LangChain's bound kwargs and
    LlamaIndex's chat kwargs share)."""

    tools: list | None = None
    tool_choice: Any = None
    structured: StructuredOutputsParams | None = None
    parallel_tool_calls: bool = False

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any], default_structure: Any = None) -> ChatOptions:
        """Take tools, tool_choice, structured_outputs and parallel_tool_calls out of a call's
        keyword arguments; `default_structure` applies when the call gives none."""
        structured = kwargs.pop("structured_outputs", None)
        if structured is None:
            structured = default_structure
        if isinstance(structured, dict):
            structured = StructuredOutputsParams(**structured)
        return cls(
            tools=kwargs.pop("tools", None) or None,
            tool_choice=kwargs.pop("tool_choice", None),
            structured=structured,
            parallel_tool_calls=bool(kwargs.pop("parallel_tool_calls", False)),
        )

    def plan(self, tool_format: Any = None) -> ToolPlan:
        """The tool plan of these options (see `plan_tools`), calls in `tool_format`'s markup
        (the model's: `model_tool_format(client)`)."""
        return plan_tools(
            self.tools, self.tool_choice, self.structured, self.parallel_tool_calls, tool_format
        )


@dataclass(slots=True)
class ChatPrompt:
    text: str  # the rendered prompt
    token_ids: list[int]
    params: SamplingParams  # with the plan's constraint (forced call or structured output)
    plan: ToolPlan

    @property
    def engine_prompt(self) -> dict[str, list[int]]:
        """What `EngineClient.process_inputs` takes: the ids (the template holds any BOS)."""
        return {"prompt_token_ids": self.token_ids}


def render_chat(
    client: EngineClient,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: Any = "auto",
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> str:
    """The prompt text for OpenAI-style messages. ValueError when the template refuses the
    conversation (its raise_exception, or a message shape it indexes into).

    chat_template: a template from an untrusted caller, used instead of the model's and
    rendered in a separate, limited process (template_sandbox.py).
    """
    from jinja2 import TemplateError

    tokenizer = client.tokenizer
    if chat_template is not None:
        tokenizer = SandboxedTemplate(tokenizer, chat_template)
    try:
        return render_chat_prompt(
            tokenizer,
            messages,
            tools=tools,
            tool_choice=tool_choice,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
            tool_format=model_tool_format(client),
        )
    except TemplateRenderError as error:
        raise ChatRequestError(str(error), "chat_template") from error
    except (TemplateError, TypeError, KeyError, IndexError) as error:
        raise ChatRequestError(
            f"the chat template rejected the messages: {error}", "messages"
        ) from error
    except ChatRequestError:
        raise
    except ValueError as error:  # transformers' checks quote the whole rendered prompt
        message = str(error)
        if len(message) <= _MAX_ERROR_CHARS:
            raise
        raise ChatRequestError(message[:_MAX_ERROR_CHARS] + " [...]", "messages") from error


def prompt_token_ids(
    client: EngineClient, text: str, guard: ContentGuard | None = None
) -> list[int]:
    """A rendered chat prompt's token ids; the template already holds any BOS token. With
    the guard that marked the conversation, its marked special-token strings stay text."""
    if guard is not None:
        return guard.token_ids(text)
    return list(client.tokenizer(text, add_special_tokens=False).input_ids)


def prepare_chat(
    client: EngineClient,
    messages: list[dict],
    params: SamplingParams,
    options: ChatOptions | None = None,
    *,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    split_special_tokens: bool = True,
    chat_template: str | None = None,
    add_special_tokens: bool = False,
    check_rendered: Callable[[str], None] | None = None,
) -> ChatPrompt:
    """Plan the tools, render and tokenize (any thread: the engine is not touched).

    `params.structured_outputs` is replaced by the plan's constraint; give a structured
    output in `options` so the tools/structure rule sees it. split_special_tokens (the
    default): special-token strings inside message content and tools are tokenized as
    text, so a message cannot forge a chat turn (chat/special_tokens.py); False lets them
    become the model's control tokens. chat_template: the caller's template instead of the
    model's (rendered in a sandbox, see `render_chat`). add_special_tokens: the tokenizer's
    BOS/EOS around the rendered prompt too (most templates write them already).
    check_rendered: called with the rendered text before it is tokenized (the server
    refuses a prompt that cannot fit there, without tokenizing it).
    """
    plan = (options or ChatOptions()).plan(model_tool_format(client))
    check_message_text(messages)
    guard = ContentGuard(client.tokenizer) if split_special_tokens else None
    text = render_chat(
        client,
        guard.mark_messages(messages) if guard is not None else messages,
        guard.mark_value(plan.tools) if guard is not None and plan.tools else plan.tools,
        plan.tool_choice,
        add_generation_prompt=add_generation_prompt,
        template_kwargs=template_kwargs,
        chat_template=chat_template,
    )
    plain = guard.unmark(text)[0] if guard is not None else text
    if check_rendered is not None:
        check_rendered(plain)
    token_ids = prompt_token_ids(client, text, guard)
    if add_special_tokens:
        token_ids = list(client.tokenizer.build_inputs_with_special_tokens(token_ids))
    text = plain
    params = params.clone(structured_outputs=plan.constraint)
    return ChatPrompt(text, token_ids, params, plan)


def check_message_text(messages: list[dict]) -> None:
    """ChatRequestError naming the message whose text the tokenizer cannot take."""
    for position, message in enumerate(messages if isinstance(messages, list | tuple) else []):
        if not isinstance(message, dict):
            continue
        try:
            check_text(content_text(message.get("content")), f"message {position}")
        except ValueError as error:
            raise ChatRequestError(str(error), "messages") from None
