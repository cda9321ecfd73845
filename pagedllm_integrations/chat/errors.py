"""Errors of the chat layer. Both are ValueErrors: a bad request, or an answer that is not
the one asked for; the server turns the first into a 400 naming `param`."""

from __future__ import annotations


class ChatRequestError(ValueError):
    """A chat request that cannot be served as given; `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class IncompleteOutputError(ValueError):
    """A forced tool call or a structured output ran out of tokens before it was complete."""
