"""A chat template sent by a client (vLLM's `chat_template` field), rendered in a sandbox.

A template is a program: jinja2's sandbox keeps it from reaching Python's internals, but not
from looping for hours or building a string of gigabytes (nested loops, `'x' * 10**9`,
`center(10**9)`), and a thread cannot be stopped. So it runs in a short-lived process of its
own (template_worker.py): started with `python -I`, an empty environment (no API key or
other secret to read) and a scratch working folder, it caps its own CPU time and memory,
and is killed when it runs past `timeout`. It costs a process start (tens of milliseconds)
per request that sends a template; the model's own template still renders in process.

`SandboxedTemplate` stands in for the tokenizer where the chat layer renders (its
`apply_chat_template` and `chat_template`), so tools, tool formats and
continue_final_message work the same with either template.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TEMPLATE_TIMEOUT_S = 5.0  # wall-clock seconds one client template may take to render
MAX_TEMPLATE_CHARS = 64 * 1024
_MEMORY_BYTES = 1 << 30  # address space of the rendering process
_MAX_OUTPUT_CHARS = 16 << 20
_WORKER = Path(__file__).with_name("template_worker.py")
_CONTINUE_TAG = "PAGEDLLM_CONTINUE_FINAL_MESSAGE"


class TemplateRenderError(ValueError):
    """The client's template failed, ran too long or used too much memory (a 400)."""


def render_in_sandbox(template: str, context: dict[str, Any], timeout: float) -> str:
    """`template` rendered with `context` (JSON-like values) in a separate, limited process."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRenderError(
            f"chat_template has {len(template)} characters; the limit is {MAX_TEMPLATE_CHARS}"
        )
    job = {
        "template": template,
        "context": context,
        "max_chars": _MAX_OUTPUT_CHARS,
        "cpu_seconds": max(int(timeout) + 1, 1),
        "memory_bytes": _MEMORY_BYTES,
    }
    with tempfile.TemporaryDirectory(prefix="pagedllm-template-") as scratch:
        process = subprocess.Popen(
            [sys.executable, "-I", str(_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={},
            cwd=scratch,
            close_fds=True,
        )
        try:
            out, _ = process.communicate(json.dumps(job).encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise TemplateRenderError(
                f"chat_template took more than {timeout:g} s to render; it was stopped"
            ) from None
    if process.returncode != 0 or not out:
        # Killed by its own CPU or memory limit, or failed before it could answer.
        raise TemplateRenderError(
            "chat_template could not be rendered within the sandbox's limits "
            f"(exit status {process.returncode})"
        )
    answer = json.loads(out)
    if "error" in answer:
        raise TemplateRenderError(f"chat_template failed: {answer['error']}")
    return str(answer["text"])


class SandboxedTemplate:
    """A tokenizer whose chat template is the client's, rendered by `render_in_sandbox`;
    everything else is the model's tokenizer."""

    def __init__(self, tokenizer: Any, template: str, timeout: float = TEMPLATE_TIMEOUT_S):
        self._tokenizer = tokenizer
        self.chat_template = template
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(
        self,
        conversation: list[dict],
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str:
        if tokenize:
            raise ValueError("a sandboxed chat template renders text only (tokenize=False)")
        messages = [dict(m) for m in conversation]
        final = ""
        if continue_final_message:
            final = _final_text(messages)
            messages[-1]["content"] = final + _CONTINUE_TAG
        context = {
            **_special_tokens(self._tokenizer),
            **template_kwargs,
            "messages": messages,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        text = render_in_sandbox(self.chat_template, context, self._timeout)
        if continue_final_message:
            cut = text.rfind(_CONTINUE_TAG)
            if cut < 0:
                raise TemplateRenderError(
                    "continue_final_message is set but chat_template does not write the final "
                    "message's content"
                )
            text = text[:cut]
        return text


def _final_text(messages: list[dict]) -> str:
    if not messages or not isinstance(messages[-1].get("content"), str):
        raise TemplateRenderError(
            "continue_final_message needs a final message with text content to continue"
        )
    return messages[-1]["content"]


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """bos_token, eos_token and the other named special tokens, as the model's own template
    sees them (strings)."""
    names = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in names.items() if isinstance(v, str | list)}
