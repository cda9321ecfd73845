"""A user's mistakes at the edges (issue 44): the CLI answers in one line, `serve --help`
works without the server extra, an image gets "images are not supported by this model" in
every front end, and the server answers GET /v1/models/{id} as OpenAI does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedllm_integrations.cli import main

# A Python that cannot import the server extra, as after `pip install pagedllm` alone:
# `serve --help`, then `serve`, each line of output prefixed with the command's number.
WITHOUT_SERVER_EXTRA = """
import contextlib, io, sys
for name in ("fastapi", "starlette", "uvicorn", "prometheus_client"):
    sys.modules[name] = None
from pagedllm_integrations.cli import main
for number, argv in enumerate([["serve", "--help"], ["serve", "--model", "x.gguf"]]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as exit:
            rc = exit.code
    print(f"{number} rc={rc}")
    for line in out.getvalue().splitlines():
        print(f"{number} {line}")
"""
IMAGE = "data:image/png;base64,iVBORw0KGgo="
NOT_SUPPORTED = "images are not supported by this model"


# ------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize(
    "argv, named",
    [
        (["generate", "--model", "llama3.1", "hi"], "llama3.1"),
        (["generate", "--model", "/no/such/model.gguf", "hi"], "/no/such/model.gguf"),
        (["generate", "--max-model-len", "1", "hi"], "max_model_len"),
        (["chat", "--block-size", "12"], "block_size"),
    ],
)
def test_cli_user_errors_are_one_line(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pagedllm {argv[0]}: ") and named in err
    assert "\n" not in err and "Traceback" not in err


def test_serve_help_works_without_the_server_extra():
    command = [sys.executable, "-P", "-c", WITHOUT_SERVER_EXTRA]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    shown = [line[2:] for line in lines if line.startswith("0 ")]
    assert shown[0] == "rc=0"
    assert any("--max-queue-len" in line for line in shown)
    assert any("--max-body-bytes" in line for line in shown)
    served = [line[2:] for line in lines if line.startswith("1 ")]  # the command needs it
    assert served[0] == "rc=2"
    assert served[1:] and served[1].startswith("pagedllm serve needs the [server] extra")


# -------------------------------------------------------------------------- images
def test_an_image_is_refused_by_name_in_langchain_and_llama_index():
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage, ImageBlock, TextBlock

    from pagedllm_integrations.langchain_messages import to_openai_messages
    from pagedllm_integrations.llama_index_convert import to_openai_messages as index_messages

    for block in (
        {"type": "image_url", "image_url": {"url": IMAGE}},  # OpenAI's part
        {"type": "image", "url": "https://example.com/cat.png"},  # LangChain's standard block
    ):
        message = HumanMessage(content=[{"type": "text", "text": "What is this?"}, block])
        with pytest.raises(ValueError, match=NOT_SUPPORTED):
            to_openai_messages([message])
    message = ChatMessage(role="user", blocks=[TextBlock(text="What is this?"),
                                               ImageBlock(url="https://example.com/cat.png")])  # fmt: skip
    with pytest.raises(ValueError, match=NOT_SUPPORTED):
        index_messages([message])


def test_an_image_is_refused_by_name_in_the_offline_chat(default_llm):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}]}]
    with pytest.raises(ValueError, match=NOT_SUPPORTED):
        default_llm.chat(messages, use_tqdm=False)


# ------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def client():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from pagedllm_integrations import EngineConfig, shared_engine
    from pagedllm_integrations.server.app import create_app
    from pagedllm_integrations.server.testing import ThreadedServer

    engine = shared_engine(
        EngineConfig(disable_log_stats=True, max_model_len=512, kv_cache_memory=128 << 20)
    )
    with ThreadedServer(create_app(engine, served_model_name="smol")) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_server_refuses_an_image_and_keeps_serving(client):
    import openai

    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": IMAGE}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert NOT_SUPPORTED in raised.value.message
    assert raised.value.body["param"] == "messages"
    reply = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": content[:1]}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None


def test_get_model_answers_as_openai_does(client):
    import openai

    model = client.models.retrieve("smol")
    assert (model.id, model.object, model.owned_by) == ("smol", "model", "pagedllm")
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    assert "gpt-4o" in missing.value.message
