"""The chat layer every front end shares: LangChain, LlamaIndex, the OpenAI server,
`LLM.chat` and the CLI.

    front end (its own types)          chat layer                        engine
    ─────────────────────────  ──────────────────────────────────  ─────────────────
    messages, tools, settings ─> prepare:  tool_choice, the one     EngineClient
                                           tools/structure rule,  ─> .process_inputs
                                           render + tokenize          .submit ...
                                 sampling: defaults < settings < call
    AIMessage / ChatResponse  <─ outputs:  tool calls, finish reason,
    / OpenAI JSON                          cut-off check, usage
                                 logprobs: OpenAI's shapes
                                 stream:   tool-call gate, abort/timeout iterators

Each front end keeps only the conversion between its framework's types and the OpenAI-style
dicts used here; everything else exists once, below, tool calls included: their formats
(`tool_formats.py`), how tools are written into a prompt, the grammar that forces a call and
reading calls back (`tool_calls.py`), the messages' rules (`chat_messages.py`). The engine
below knows nothing of chat.
"""
