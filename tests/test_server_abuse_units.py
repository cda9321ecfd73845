"""The pieces behind issue 43's fixes, without a server: the character bound on prompts
(never above the real token count, for the tokenizers it applies to, and off for those it
cannot bound), the API key's sources, and the sandbox a client's chat template runs in."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedllm_integrations.chat.template_sandbox import TemplateRenderError, render_in_sandbox
from pagedllm_integrations.server.api_key import API_KEY_ENV, resolve_api_key
from pagedllm_integrations.server.prompt_bound import PromptBound, longest_token_chars

# ------------------------------------------------------------------ the prompt bound
# Texts that pack the most characters into the fewest tokens, and the least.
WORST_CASES = [
    ("\n" + " " * 80) * 50,
    "#" * 8000,
    "<|im_start|>" * 300,
    "<|im_start|><|im_end|>user\n" * 100,
    " " * 5000,
    "\t\n\r " * 1000,
    "0123456789" * 300,
    "é" * 500 + "😀" * 300 + "\u0301" * 300,
    "".join(chr(c) for c in range(32, 20000, 7)),
]
TRICKY = st.lists(
    st.sampled_from(["\n", " ", "#", "a", "é", "😀", "\u0301", "<|im_end|>", "1", "\t"]),
    max_size=400,
).map("".join)


@pytest.fixture(scope="module")
def smollm_tokenizer(default_model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_folder)


def sentencepiece_like(fuse_unk: bool = False) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: BPE with byte fallback, spaces made `▁` by the normalizer
    (fuse_unk: runs of unknown characters become one <unk> token instead)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab", "▁▁", "▁▁▁▁", "▁▁▁▁▁▁▁▁"]
    for piece in pieces:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁a", "b"), ("▁", "▁"), ("▁▁", "▁▁"), ("▁▁▁▁", "▁▁▁▁")]
    model = models.BPE(
        vocab, merges, unk_token="<unk>", byte_fallback=not fuse_unk, fuse_unk=fuse_unk
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def assert_bound_holds(tokenizer, texts, chars: int | None = None) -> None:
    if chars is None:
        chars, reason = longest_token_chars(tokenizer)
        assert chars is not None, reason
    bound = PromptBound(max_model_len=1 << 30, token_chars=chars)
    for text in texts:
        tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert tokens >= bound.min_tokens(len(text)), (text[:40], tokens, chars)


def test_the_bound_holds_for_a_byte_level_bpe(smollm_tokenizer):
    assert longest_token_chars(smollm_tokenizer) == (81, "")
    assert_bound_holds(smollm_tokenizer, WORST_CASES)


@settings(max_examples=200, deadline=None)
@given(text=TRICKY)
def test_the_bound_holds_for_any_text(smollm_tokenizer, text):
    assert_bound_holds(smollm_tokenizer, [text], chars=81)  # (measured in the test above)


def test_the_bound_holds_for_a_sentencepiece_style_bpe():
    tokenizer = sentencepiece_like()
    assert longest_token_chars(tokenizer) == (8, "")  # "▁▁▁▁▁▁▁▁" and "<0xE2>" stand for more
    assert_bound_holds(tokenizer, [" " * 64, "ab ab  ab", "é😀" * 10, *WORST_CASES[:4]])
    # One <unk> for a run of unknown characters: no bound holds, so none is given.
    fused = sentencepiece_like(fuse_unk=True)
    assert len(fused("éééééééééééé", add_special_tokens=False).input_ids) <= 2
    assert longest_token_chars(fused)[0] is None


@pytest.mark.parametrize(
    ("component", "kind"),
    [
        (normalizers.NFKC(), "normalizer"),
        (normalizers.StripAccents(), "normalizer"),
        (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Lowercase()]), "normalizer"),
        (pre_tokenizers.Whitespace(), "pre_tokenizer"),
        (pre_tokenizers.Split(" ", behavior="removed"), "pre_tokenizer"),
    ],
)
def test_no_bound_for_a_tokenizer_that_may_shorten_the_text(component, kind):
    tokenizer = Tokenizer(models.BPE({"a": 0, "b": 1}, [], byte_fallback=False))
    setattr(tokenizer, kind, component)
    chars, reason = longest_token_chars(PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    assert chars is None and kind.replace("_", "-") in reason
    bound = PromptBound(max_model_len=4, token_chars=chars)
    bound.check(10**9, None, "prompt")  # no bound: nothing is refused before tokenizing


def test_no_bound_for_wordpiece():
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    chars, reason = longest_token_chars(PreTrainedTokenizerFast(tokenizer_object=wordpiece))
    assert chars is None and "WordPiece" in reason


# ------------------------------------------------------------------ the API key
def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    key_file.chmod(0o600)
    assert resolve_api_key(None, str(key_file), environ={}) == "s3cret-key"
    assert resolve_api_key(None, None, environ={API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key(None, None, environ={}) is None
    # A flag wins over the environment.
    assert resolve_api_key(None, str(key_file), environ={API_KEY_ENV: "x"}) == "s3cret-key"
    with caplog.at_level(logging.WARNING):
        assert resolve_api_key("on-the-line", None, environ={}) == "on-the-line"
    assert "ps" in caplog.text
    caplog.clear()
    key_file.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        resolve_api_key(None, str(key_file), environ={})
    assert "chmod 600" in caplog.text


@pytest.mark.parametrize(
    ("key", "key_file_text", "environ", "message"),
    [
        ("a", "b", {}, "not both"),
        (None, "", {}, "one line"),
        (None, "two\nlines\n", {}, "one line"),
        (None, None, {API_KEY_ENV: ""}, "empty"),
        (None, None, {API_KEY_ENV: "has space"}, "printable ASCII"),
        ("naïve", None, {}, "printable ASCII"),
    ],
)
def test_a_bad_api_key_is_refused(tmp_path, key, key_file_text, environ, message):
    path = None
    if key_file_text is not None:
        path = tmp_path / "key"
        path.write_text(key_file_text)
    with pytest.raises(ValueError, match=message):
        resolve_api_key(key, str(path) if path else None, environ=environ)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"), environ={})


@pytest.mark.parametrize(
    ("arguments", "environ", "message"),
    [
        (["--api-key-file", "/nonexistent/key"], {}, "cannot read the API key file"),
        (["--api-key", "a", "--api-key-file", "b"], {}, "not both"),
        ([], {API_KEY_ENV: "two words"}, "printable ASCII"),
    ],
)
def test_serve_refuses_a_bad_api_key_before_loading_the_model(
    monkeypatch, capsys, arguments, environ, message
):
    from pagedllm_integrations.cli import main

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--model", "/nonexistent/model.gguf", *arguments]) == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ the template sandbox
def test_a_template_that_runs_too_long_is_stopped():
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateRenderError, match="stopped"):
        render_in_sandbox(loop, {}, timeout=1.0)  # killed: it would run for hours


def test_a_template_sees_no_environment_variables(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_API_KEY", "do-not-leak")
    # The sandbox has no os, and the process has an empty environment besides.
    text = render_in_sandbox("{{ messages[0].content }}", {"messages": [{"content": "hi"}]}, 5)
    assert text == "hi"
    with pytest.raises(TemplateRenderError, match=r"unsafe|undefined|has no attribute"):
        render_in_sandbox("{{ cycler.__init__.__globals__.os.environ }}", {}, 5)


# ------------------------------------------------------------------ the defaults
def test_serve_defaults_are_the_documented_ones():
    import argparse

    from pagedllm_integrations.server.cli import add_arguments
    from pagedllm_integrations.server.connections import (
        ConnectionLimits,
        default_max_connections,
        default_max_per_client,
        descriptor_limit,
    )

    parser = argparse.ArgumentParser()
    add_arguments(parser, "serve")
    args = parser.parse_args([])
    assert (args.header_timeout, args.body_timeout, args.keep_alive_timeout) == (10, 30, 75)
    assert args.shutdown_timeout == 30 and args.allow_unknown_fields is False
    assert args.max_connections is None and args.max_connections_per_client is None
    assert args.api_key is None and args.api_key_file is None
    # No caps given: from the descriptor limit, so one address never holds them all.
    assert (default_max_connections(256), default_max_per_client(192)) == (192, 96)
    assert (default_max_connections(1024), default_max_per_client(960)) == (960, 256)
    total = default_max_connections(descriptor_limit())
    assert ConnectionLimits().resolved() == (total, default_max_per_client(total))
    assert ConnectionLimits(max_connections=0, max_connections_per_client=0).resolved() == (
        None,
        None,
    )
    with pytest.raises(ValueError, match="header_timeout"):
        ConnectionLimits(header_timeout=0)
