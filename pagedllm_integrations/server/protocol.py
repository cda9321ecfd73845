"""Request bodies of the OpenAI API as pydantic models (OpenAI's field names).

Only the shape and the plain ranges are checked here; what needs the model (prompt length,
vocabulary, tool names) is checked by the engine and the route, and every failure becomes a
400 with OpenAI's error body. Besides OpenAI's fields, the ones of vLLM's and llama.cpp's
servers that pagedllm honours are declared here; the ones it cannot honour are refused by
name (peer_fields.py), and so is any other field unless the server allows unknown fields.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..chat.chat_messages import not_text_message
from ..chat.errors import ChatRequestError

# Bounds that keep one request from exhausting the server (vLLM has none; OpenAI's are lower).
MAX_N = 128
MAX_PROMPTS = 256
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 64
MAX_CACHE_SALT = 256
MAX_REQUEST_ID = 256
MAX_FUNCTIONS = 128
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP)] | None
# OpenAI keys logit_bias by token id written as a string; values are clamped to [-100, 100].
LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class _Request(_Body):
    """A request body: its undeclared fields are kept (`model_extra`) to be refused by name
    or, when the server allows unknown fields, ignored (peer_fields.py)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by both routes (OpenAI's, then vLLM's and llama.cpp's extras)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] | None = None
    stop: Stop = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias = None
    user: str | None = None
    # vLLM's extras, accepted by the same names.
    top_k: int | None = None
    min_p: FiniteFloat | None = None
    repetition_penalty: FiniteFloat | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: mixed into the prefix-cache hashes, so only requests with the same salt share
    # cached blocks (one salt per tenant keeps tenants from probing each other's prompts).
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)] | None = None
    # vLLM's: keep only the last k prompt tokens (-1: as many as fit the context).
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    request_id: Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID)] | None = None
    add_special_tokens: bool | None = None  # default: true for completions, false for chat
    # Structured output, in every server's spelling (at most one of them; see structured.py).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: dict[str, Any] | None = None
    grammar: str | None = None  # llama.cpp: a GBNF grammar
    json_schema: dict[str, Any] | None = None  # llama.cpp: a JSON schema
    # llama.cpp's names for max_tokens (-1: no limit) and repetition_penalty.
    n_predict: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    repeat_penalty: FiniteFloat | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallItem(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Body):
    type: Literal["text"]
    text: str


class OtherPart(_Body):
    """A content part that is not text (image_url, input_audio, file): accepted by the
    schema so that the error can say what is wrong with it (ChatMessage.text)."""

    type: str

    @field_validator("type")
    @classmethod
    def _not_text(cls, value: str) -> str:
        if value == "text":
            raise ValueError("a text part needs its 'text'")
        return value


class ChatMessage(_Request):
    # Undeclared fields are kept to be refused by name (peer_fields.check_message_fields).
    # "function": a legacy function result (OpenAI's `functions` API), read as a tool result.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None  # a legacy call in an assistant turn

    def text(self) -> str | None:
        if isinstance(self.content, list):
            for part in self.content:
                if isinstance(part, OtherPart):
                    raise ChatRequestError(not_text_message(part.type), "messages")
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class FunctionCallChoice(_Body):
    name: str


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Special-token strings inside message content stay text (true, the default), so a
    # message cannot open a forged turn; false lets them become the model's control tokens.
    split_special_tokens: bool = True
    # OpenAI's legacy function calling: `functions` are tools, `function_call` the choice.
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_FUNCTIONS)] | None = None
    function_call: Literal["none", "auto"] | FunctionCallChoice | None = None
    # vLLM's chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
