"""Models Ollama has pulled load by their Ollama name (issue 44).

The store is laid out as Ollama writes it (manifests/registry.ollama.ai/library/<model>/<tag>
naming content-addressed blobs/sha256-<hex>), made in a temporary folder from the embedded
default GGUF, with a params layer, a Go template and a system prompt beside the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from pagedllm_integrations import SamplingParams
from pagedllm_integrations.engine import ollama_store
from pagedllm_integrations.engine.model_loader import default_model_path, resolve_model

pytest.importorskip("langchain_core")

PARAMS = {
    "temperature": 0,
    "stop": ["<|im_end|>", "."],
    "num_ctx": 1024,
    "num_predict": 40,
    "repeat_last_n": 64,  # no pagedllm equivalent: noted
}
TEMPLATE = "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}..."


def _blob(store: Path, data: bytes | None = None, source: Path | None = None) -> dict:
    """Write a blob as Ollama does (named by the sha256 of its bytes); its layer entry."""
    (store / "blobs").mkdir(parents=True, exist_ok=True)
    if source is not None:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
        shutil.copyfile(source, store / "blobs" / f"sha256-{digest}")
        size = source.stat().st_size
    else:
        assert data is not None
        digest = hashlib.sha256(data).hexdigest()
        (store / "blobs" / f"sha256-{digest}").write_bytes(data)
        size = len(data)
    return {"digest": f"sha256:{digest}", "size": size}


def write_store(
    store: Path,
    name: str,
    tag: str,
    extra_layers: tuple = (),
    gguf: Path | None = None,
    params: dict | None = None,
) -> Path:
    """A pulled model: `gguf` (the embedded default) with a chat model's template, system
    prompt and PARAMS; with `params`, only those beside the file (an embedding model's)."""
    chat_layers = [
        {"mediaType": "application/vnd.ollama.image.template",
         **_blob(store, TEMPLATE.encode())},
        {"mediaType": "application/vnd.ollama.image.system",
         **_blob(store, b"You are a helpful assistant.")},
    ]  # fmt: skip
    layers = [
        {"mediaType": "application/vnd.ollama.image.model", **_blob(store, source=gguf or GGUF)},
        *(chat_layers if params is None else []),
        {"mediaType": "application/vnd.ollama.image.params",
         **_blob(store, json.dumps(PARAMS if params is None else params).encode())},
        *extra_layers,
    ]  # fmt: skip
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_1"})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   **_blob(store, config.encode())},
        "layers": layers,
    }  # fmt: skip
    path = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return path


GGUF = default_model_path()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ollama") / "models"
    write_store(root, "smollm2", "135m")
    write_store(root, "smollm2", "latest")
    return root


@pytest.fixture
def ollama_env(store, monkeypatch) -> Path:
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    return store


def test_a_tag_loads_the_blob_with_its_parameters_end_to_end(ollama_env, default_llm, caplog):
    from pagedllm_integrations.langchain import ChatPagedLLM

    question = "What is the capital of France? Answer in one sentence."
    with caplog.at_level(logging.INFO, logger="pagedllm_integrations.engine.ollama_store"):
        chat = ChatPagedLLM(model="smollm2:135m", engine_kwargs={"kv_cache_memory": 96 << 20})
        try:
            reply = chat.invoke(question)
            own_stop = chat.invoke(question, stop=["France"])  # replaces the model's stops
            info = chat.engine.model_info
        finally:
            chat.close()
    assert info.name == "smollm2:135m"
    assert info.max_model_len == 1024  # num_ctx
    assert info.generation_defaults == {
        "temperature": 0, "stop": ["<|im_end|>", "."], "max_tokens": 40,
    }  # fmt: skip
    assert "repeat_last_n" in caplog.text  # said, not silently dropped
    assert "Go template" in caplog.text and "system prompt" in caplog.text
    # The reference: the same GGUF given as a file, with those settings given by hand.
    expected = default_llm.chat(
        [{"role": "user", "content": question}],
        SamplingParams(temperature=0, stop=["<|im_end|>", "."], max_tokens=40),
        use_tqdm=False,
    )[0].outputs[0]
    assert reply.content == expected.text
    assert reply.usage_metadata["output_tokens"] == len(expected.token_ids)
    replaced = (
        default_llm.chat(
            [{"role": "user", "content": question}],
            SamplingParams(temperature=0, stop=["France"], max_tokens=40),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .text
    )
    assert own_stop.content == replaced != expected.text


def test_names_without_a_tag_mean_latest_and_the_store_comes_before_the_hub(ollama_env):
    for name in ("smollm2", "smollm2:latest", "library/smollm2:latest"):
        source = resolve_model(name)
        assert source.name == name and source.context_length == 1024
        assert source.sampling_defaults["stop"] == ["<|im_end|>", "."]
    # Both tags hold the same blob: one converted folder, pointed at this store's copy.
    assert resolve_model("smollm2:135m").folder == resolve_model("smollm2").folder
    from pagedllm_integrations.engine.gguf_loader import gguf_file_of

    assert gguf_file_of(resolve_model("smollm2").folder).parent == ollama_env / "blobs"


def test_a_tag_that_is_not_pulled_says_how_to_pull_it(ollama_env):
    from pagedllm_integrations.langchain import ChatPagedLLM

    with pytest.raises(ValueError, match=r"'qwen3:0\.6b' is not pulled.*ollama pull qwen3:0\.6b"):
        ChatPagedLLM(model="qwen3:0.6b", validate_model_on_init=True)
    with pytest.raises(ValueError, match=r"'smollm2:1\.7b' is not pulled"):
        resolve_model("smollm2:1.7b")


def test_a_missing_blob_or_an_adapter_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    adapter = {"mediaType": "application/vnd.ollama.image.adapter", **_blob(tmp_path, b"lora")}
    write_store(tmp_path, "tuned", "latest", extra_layers=(adapter,))
    with pytest.raises(ValueError, match="LoRA adapter"):
        resolve_model("tuned")
    manifest = write_store(tmp_path, "broken", "v1")
    model_layer = json.loads(manifest.read_text())["layers"][0]
    (tmp_path / "blobs" / model_layer["digest"].replace(":", "-")).unlink()
    with pytest.raises(ValueError, match="missing its blob"):
        resolve_model("broken:v1")


def test_manifest_paths_follow_ollamas_naming(monkeypatch, tmp_path):
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path))
    base = tmp_path / "manifests"
    assert (
        ollama_store.manifest_path("llama3.1")
        == base / "registry.ollama.ai/library/llama3.1/latest"
    )
    assert (
        ollama_store.manifest_path("qwen3:0.6b") == base / "registry.ollama.ai/library/qwen3/0.6b"
    )
    assert ollama_store.manifest_path("user/model:v2") == base / "registry.ollama.ai/user/model/v2"
    assert (ollama_store.manifest_path("hf.co/org/repo:Q4_K_M")
            == base / "hf.co/org/repo/Q4_K_M")  # fmt: skip
    assert ollama_store.manifest_path("not a name") is None
    monkeypatch.delenv("OLLAMA_MODELS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ollama_store.models_dir() == tmp_path / ".ollama" / "models"


def test_ollama_parameters_map_onto_sampling_settings():
    defaults, context = ollama_store.map_params(
        {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repeat_penalty": 1.1,
         "seed": 3, "stop": "<end>", "num_predict": -1, "num_ctx": 4096,
         "presence_penalty": 0.5, "frequency_penalty": 0.25},
        "m",
    )  # fmt: skip
    assert context == 4096
    assert defaults == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
                        "repetition_penalty": 1.1, "seed": 3, "stop": ["<end>"],
                        "presence_penalty": 0.5, "frequency_penalty": 0.25}  # fmt: skip
    SamplingParams(**defaults)  # every mapped value is one pagedllm takes
    with pytest.raises(ValueError, match="temperature"):
        ollama_store.map_params({"temperature": -1}, "m")
