"""Tool-call formats: how each model family was trained to see tools and to write calls.

One `ToolCallFormat` per syntax, chosen from the model (`tool_format_for`: its chat
template first, its architecture next). A format renders the tools into the prompt (or
lets the chat template do it where the template knows tools), writes earlier calls and
tool results back into a conversation, builds the grammar that forces a call, and reads
calls out of generated text.

    hermes   Qwen2.5/Qwen3 (and the default, SmolLM2's prompt section):
             <tool_call>
             {"name": "get_weather", "arguments": {"city": "Paris"}}
             </tool_call>
    phi4     Phi-4-mini: tools as a JSON list in the system turn, <|tool|>[...]<|/tool|>;
             calls as <|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>
    gemma    Gemma 2/3 (no tool tokens: prompting, as Google's function-calling guide
             describes): the tool definitions as JSON with instructions in the first user
             turn; a call is {"name": "get_weather", "parameters": {"city": "Paris"}}, the
             call Llama 3.1+ templates ask for too (their template renders the tools).
             The guide's other variant, Python calls [get_weather(city="Paris")], is read
             too, but the grammar forces the JSON one: it is the one whose arguments a JSON
             schema constrains exactly.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from .chat_messages import (
    ToolCall,
    arguments_schema,
    call_entries,
    call_from_json,
    call_from_object,
    content_text,
    messages_for_template,
    new_call_id,
    parse_bare_json,
    parse_tagged_blocks,
    strip_code_fence,
)


class ToolCallFormat:
    """The markup of one family's tool calls. Subclasses fill in the syntax."""

    name = "?"
    call_open = ""  # text every call starts with ("" for none): streaming holds output from it
    default_system = ""  # system text to put tools under when a conversation has none

    # ------------------------------------------------------------------ to fill in
    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        """An assistant turn's calls, written as the model writes them."""
        raise NotImplementedError

    def tools_section(self, tools: list[dict], mode: str, forced: str | None) -> str:
        """The tool definitions and calling instructions, for the system turn."""
        raise NotImplementedError

    def call_alternatives(self, tools: list[dict]) -> list[tuple[str, dict, str]]:
        """(text before the arguments, arguments JSON schema, text after) per tool."""
        raise NotImplementedError

    def parse(self, text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
        """(remaining content, calls) from generated text."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    parallel_separator = "\n"

    def constraint_grammar(self, tools: list[dict], parallel: bool, max_calls: int) -> str:
        """A grammar for one call of any of `tools` (1..max_calls calls when parallel)."""
        from ..engine.structured_outputs import tagged_json_grammar

        alternatives = self.call_alternatives(tools)
        if parallel and max_calls > 1:
            return tagged_json_grammar(alternatives, self.parallel_separator, max_calls)
        return tagged_json_grammar(alternatives)

    def render(
        self,
        tokenizer: Any,
        messages: list[dict],
        tools: list[dict],
        tool_choice: Any,
        mode: str,
        forced: str | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt: the template's own tool rendering where it has one, else plain turns
        with the tools section in the system turn. template_kwargs: more template variables
        (e.g. enable_thinking)."""
        extra = dict(template_kwargs or {})
        if tools and template_renders_tools(tokenizer):
            return tokenizer.apply_chat_template(
                messages_for_template(messages),
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        turns = self.plain_turns(messages)
        if tools:
            self.add_to_system(turns, self.tools_section(tools, mode, forced))
        return tokenizer.apply_chat_template(
            [{"role": m["role"], "content": m["content"]} for m in turns],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )

    def plain_turns(self, messages: list[dict]) -> list[dict]:
        """{role, content} turns for a template that knows no tools: calls written in this
        format's markup, tool results as one user turn per run of results."""
        out: list[dict] = []
        for message in messages:
            role = "system" if message["role"] == "developer" else message["role"]
            content = content_text(message.get("content"))
            if role == "assistant" and message.get("tool_calls"):
                calls = self.format_calls(call_entries(message))
                content = "\n".join(([content] if content else []) + [calls])
            if role == "tool":
                block = self.tool_result(content)
                if out and out[-1].get("_tool_results"):
                    out[-1]["content"] += "\n" + block
                else:
                    out.append({"role": "user", "content": block, "_tool_results": True})
                continue
            out.append({"role": role, "content": content})
        return out

    def tool_result(self, content: str) -> str:
        return content

    def add_to_system(self, turns: list[dict], section: str) -> None:
        if turns and turns[0]["role"] == "system":
            first = turns[0]["content"]
            turns[0]["content"] = f"{first}\n\n{section}" if first else section
        else:
            system = f"{self.default_system}\n\n{section}" if self.default_system else section
            turns.insert(0, {"role": "system", "content": system})


def _forced_line(mode: str, forced: str | None) -> list[str]:
    if mode == "required":
        return ["You must call at least one of the functions now."]
    if mode == "named":
        return [f"You must call the function {forced} now."]
    return []


# ---------------------------------------------------------------------------- hermes
class HermesFormat(ToolCallFormat):
    name = "hermes"
    call_open = "<tool_call>"
    close = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(
            f"{self.call_open}\n{json.dumps({'name': n, 'arguments': a})}\n{self.close}"
            for n, a in calls
        )

    def tools_section(self, tools: list[dict], mode: str, forced: str | None) -> str:
        lines = [
            "# Tools",
            "",
            "You may call one or more functions to help with the user's request. The functions "
            "available, with the JSON schema of their arguments:",
            "",
            "<tools>",
            *[json.dumps(t["function"]) for t in tools],
            "</tools>",
            "",
            "To call a function, reply with a JSON object of its name and arguments inside "
            "<tool_call></tool_call> tags, one block per call:",
            self.format_calls([("function_name", {"argument_name": "value"})]),
            "Results come back inside <tool_response></tool_response> tags.",
        ]
        return "\n".join(lines + _forced_line(mode, forced))

    def tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"

    def call_alternatives(self, tools: list[dict]) -> list[tuple[str, dict, str]]:
        return [
            (
                f'{self.call_open}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
                arguments_schema(t["function"]["parameters"]),
                f"}}\n{self.close}",
            )
            for t in tools
        ]

    def parse(self, text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
        if self.call_open in text:
            return parse_tagged_blocks(text, self._block, known)
        return parse_bare_json(text, known)


# ---------------------------------------------------------------------------- phi-4
class Phi4Format(ToolCallFormat):
    name = "phi4"
    call_open = "<|tool_call|>"
    close = "<|/tool_call|>"
    default_system = "You are a helpful assistant with some tools."
    parallel_separator = ", "
    _block = re.compile(r"<\|tool_call\|>(.*?)(?:<\|/tool_call\|>|$)", re.S)

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return f"{self.call_open}{body}{self.close}"

    def tools_section(self, tools: list[dict], mode: str, forced: str | None) -> str:
        definitions = json.dumps([t["function"] for t in tools])
        return "\n".join([f"<|tool|>{definitions}<|/tool|>", *_forced_line(mode, forced)])

    def render(
        self,
        tokenizer,
        messages,
        tools,
        tool_choice,
        mode,
        forced,
        add_generation_prompt,
        template_kwargs=None,
    ):
        """Phi-4-mini's template reads the tool list from the system message's `tools` field
        (a JSON string) and writes <|tool|>...<|/tool|> itself; other templates get it inline."""
        turns = self.plain_turns(messages)
        template = template_text(tokenizer)
        if tools and "message['tools']" in template:
            if not turns or turns[0]["role"] != "system":
                turns.insert(0, {"role": "system", "content": self.default_system})
            turns[0]["tools"] = json.dumps([t["function"] for t in tools])
            extra = _forced_line(mode, forced)
            if extra:
                turns[0]["content"] = "\n".join([turns[0]["content"], *extra])
        elif tools:
            self.add_to_system(turns, self.tools_section(tools, mode, forced))
        keep = ("role", "content", "tools")
        return tokenizer.apply_chat_template(
            [{k: v for k, v in m.items() if k in keep} for m in turns],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **dict(template_kwargs or {}),
        )

    def plain_turns(self, messages: list[dict]) -> list[dict]:
        # Phi-4-mini's template writes any role as <|role|>: tool results keep their role.
        out = []
        for message in messages:
            if message["role"] == "tool":
                out.append({"role": "tool", "content": content_text(message.get("content"))})
            else:
                out.extend(super().plain_turns([message]))
        return out

    def call_alternatives(self, tools: list[dict]) -> list[tuple[str, dict, str]]:
        return [
            (
                f'{self.call_open}[{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
                arguments_schema(t["function"]["parameters"]),
                f"}}]{self.close}",
            )
            for t in tools
        ]

    def constraint_grammar(self, tools: list[dict], parallel: bool, max_calls: int) -> str:
        """Several calls are one JSON list inside one <|tool_call|> block."""
        if not (parallel and max_calls > 1):
            return super().constraint_grammar(tools, parallel, max_calls)
        from ..engine.structured_outputs import tagged_json_grammar, wrap_grammar

        items = [
            (
                f'{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
                arguments_schema(t["function"]["parameters"]),
                "}",
            )
            for t in tools
        ]
        inner = tagged_json_grammar(items, self.parallel_separator, max_calls)
        return wrap_grammar(inner, f"{self.call_open}[", f"]{self.close}")

    def parse(self, text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
        """Tagged blocks; or, since <|tool_call|> is a special token that detokenizing with
        skip_special_tokens drops, the bare JSON list it opened (the close tag may remain)."""
        if self.call_open in text:
            return parse_tagged_blocks(text, self._block, known)
        return parse_bare_json(text.strip().removesuffix(self.close), known)


# ---------------------------------------------------------------------------- gemma
class GemmaFormat(ToolCallFormat):
    name = "gemma"
    call_open = ""  # a call is bare JSON (or a Python call list): no marker to wait for

    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)

    def tools_section(self, tools: list[dict], mode: str, forced: str | None) -> str:
        lines = [
            "You have access to functions. If you decide to invoke any of the function(s), you "
            "MUST put it in the format of",
            '{"name": function name, "parameters": dictionary of argument name and its value}',
            "You SHOULD NOT include any other text in the response if you call a function",
            json.dumps([t["function"] for t in tools], indent=2),
        ]
        return "\n".join(lines + _forced_line(mode, forced))

    def call_alternatives(self, tools: list[dict]) -> list[tuple[str, dict, str]]:
        return [
            (
                f'{{"name": {json.dumps(t["function"]["name"])}, "parameters": ',
                arguments_schema(t["function"]["parameters"]),
                "}",
            )
            for t in tools
        ]

    def parse(self, text: str, known: set[str] | None) -> tuple[str, list[ToolCall]]:
        body = strip_code_fence(text.strip())
        lines = [line for line in body.splitlines() if line.strip()]
        if len(lines) > 1:  # one call per line; lines that are not calls stay content
            parsed = [call_from_json(line, known) for line in lines]
            if any(p is not None for p in parsed):
                rest = [line for line, p in zip(lines, parsed) if p is None]
                return "\n".join(rest), [call for p in parsed if p is not None for call in p]
        content, calls = parse_bare_json(text, known)
        if calls:
            return content, calls
        python_calls = _python_calls(body, known)
        return ("", python_calls) if python_calls else (text, [])


def _python_calls(text: str, known: set[str] | None) -> list[ToolCall] | None:
    """[f(a=1, b="x"), g()] (the Python variant of Gemma's prompt): calls with literal
    keyword arguments, or None when the text is not exactly that."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # model output: anything
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        if known is not None and node.func.id not in known:
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        calls.append(ToolCall(new_call_id(), node.func.id, arguments))
    return calls or None


# ---------------------------------------------------------------------------- choice
# What Llama 3.1+ chat templates tell the model when they render tools.
_JSON_CALL_INSTRUCTION = '{"name": function name, "parameters": dictionary of argument name'
HERMES = HermesFormat()
PHI4 = Phi4Format()
GEMMA = GemmaFormat()
FORMATS = {f.name: f for f in (HERMES, PHI4, GEMMA)}


def template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the "tool_use" one, else the default
        template = template.get("tool_use") or template.get("default") or ""
    return template if isinstance(template, str) else ""


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template itself writes the `tools` it is given."""
    text = template_text(tokenizer)
    return bool(re.search(r"\btools\b", text)) and "message['tools']" not in text


def tool_format_for(tokenizer: Any, architecture: str | None = None) -> ToolCallFormat:
    """The format this model was trained on: the markup its chat template writes, else the
    family's (Gemma, Phi), else Hermes."""
    template = template_text(tokenizer)
    if "<tool_call>" in template:
        return HERMES
    if "<|tool_call|>" in template or "<|tool|>" in template:
        return PHI4
    if "<start_of_turn>" in template or _JSON_CALL_INSTRUCTION in template:
        return GEMMA  # Llama 3.1+ templates ask for the same {"name", "parameters"} call
    architecture = architecture or ""
    if architecture.startswith("Gemma"):
        return GEMMA
    if architecture.startswith("Phi3"):
        return PHI4
    return HERMES


def model_tool_format(client: Any) -> ToolCallFormat:
    """The tool-call markup the model an `EngineClient` serves was trained on: what the chat
    layer renders tools in, forces calls in and parses calls from."""
    return tool_format_for(client.tokenizer, client.model_info.architecture)


def resolve_format(tool_format: ToolCallFormat | str | None) -> ToolCallFormat:
    if tool_format is None:
        return HERMES
    if isinstance(tool_format, ToolCallFormat):
        return tool_format
    if tool_format in FORMATS:
        return FORMATS[tool_format]
    raise ValueError(f"unknown tool-call format {tool_format!r}; known: {sorted(FORMATS)}")


__all__ = [
    "FORMATS",
    "ToolCallFormat",
    "call_from_object",
    "model_tool_format",
    "resolve_format",
    "template_renders_tools",
    "tool_format_for",
]
