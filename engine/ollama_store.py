"""Models that Ollama has already pulled, loaded by their Ollama name (`qwen3:0.6b`).

Ollama keeps a model as an OCI-style manifest and content-addressed blobs under
`$OLLAMA_MODELS`, else `~/.ollama/models`:

    manifests/<host>/<namespace>/<model>/<tag>      JSON: {"schemaVersion": 2, "config": ...,
                                                     "layers": [{"mediaType", "digest", "size"}]}
    blobs/sha256-<hex>                               each layer's bytes, named by its digest

A name is `[host/][namespace/]model[:tag]`, with Ollama's defaults `registry.ollama.ai`,
`library` and `latest`. The layers pagedllm reads:

    application/vnd.ollama.image.model     the GGUF file: loaded in place, converted once
    application/vnd.ollama.image.params    JSON of Modelfile PARAMETERs: the ones listed in
                                           _PARAMS become sampling defaults (a request's own
                                           settings win), num_ctx the context length
    application/vnd.ollama.image.template  a Go text/template, which pagedllm cannot run: the
                                           GGUF's own Jinja chat template (from which Ollama's
                                           library templates are written) is used instead
    application/vnd.ollama.image.system    a default system prompt: not applied (said once)

Adapters and projectors (LoRA, vision) are refused: the model would not be the one Ollama
runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
_MODEL = "application/vnd.ollama.image.model"
_PARAMS = "application/vnd.ollama.image.params"
_TEMPLATE = "application/vnd.ollama.image.template"
_SYSTEM = "application/vnd.ollama.image.system"
_REFUSED = {
    "application/vnd.ollama.image.adapter": "a LoRA adapter",
    "application/vnd.ollama.image.projector": "a vision projector",
}
# Ollama PARAMETER -> SamplingParams field.
_SAMPLING_PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "num_predict": "max_tokens",
}
# `[host/][namespace/]model[:tag]`: each part letters, digits, '.', '_', '-'.
_NAME = re.compile(r"^(?:([\w.-]+)/)??(?:([\w.-]+)/)?([\w.-]+)(?::([\w.-]+))?$")


@dataclass(slots=True)
class OllamaModel:
    name: str  # as the user gave it, with its tag
    gguf: Path  # the model blob
    digest: str  # its sha256, hex
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None  # num_ctx


def models_dir() -> Path:
    """Ollama's model store: `$OLLAMA_MODELS`, else `~/.ollama/models`."""
    return Path(os.path.expanduser(os.environ.get("OLLAMA_MODELS") or "~/.ollama/models"))


def manifest_path(name: str) -> Path | None:
    """Where Ollama keeps the manifest of `name` (None when it is not an Ollama name)."""
    match = _NAME.match(name)
    if match is None:
        return None
    host, namespace, model, tag = match.groups()
    if host is not None and namespace is None:  # one slash: namespace/model
        host, namespace = None, host
    return (
        models_dir()
        / "manifests"
        / (host or DEFAULT_HOST)
        / (namespace or DEFAULT_NAMESPACE)
        / model
        / (tag or DEFAULT_TAG)
    )


def is_pulled(name: str) -> bool:
    path = manifest_path(name)
    return path is not None and path.is_file()


def open_model(name: str) -> OllamaModel:
    """The pulled model `name`; ValueError saying how to pull it when it is not there."""
    path = manifest_path(name)
    if path is None:
        raise ValueError(f"{name!r} is not an Ollama model name ([namespace/]model[:tag])")
    if not path.is_file():
        raise ValueError(
            f"the Ollama model {name!r} is not pulled: no manifest at {path} (run `ollama pull "
            f"{name}`, or set OLLAMA_MODELS to the folder Ollama keeps its models in)"
        )
    try:
        layers = json.loads(path.read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not an Ollama manifest: {error}") from error
    by_type: dict[str, dict] = {}
    for layer in layers:
        media_type = str(layer.get("mediaType", ""))
        if media_type in _REFUSED:
            raise ValueError(
                f"the Ollama model {name!r} adds {_REFUSED[media_type]} to its weights, "
                "which pagedllm does not load; give the base model instead"
            )
        by_type.setdefault(media_type, layer)
    if _MODEL not in by_type:
        raise ValueError(f"the Ollama manifest {path} has no model layer ({_MODEL})")
    gguf, digest = _blob(by_type[_MODEL], name)
    model = OllamaModel(name, gguf, digest)
    if _PARAMS in by_type:
        params = json.loads(_blob(by_type[_PARAMS], name)[0].read_text())
        model.sampling_defaults, model.context_length = map_params(params, name)
    if _SYSTEM in by_type:
        logger.info(
            "%s: Ollama's default system prompt is not applied; give a system message", name
        )
    if _TEMPLATE in by_type:
        logger.info("%s: using the GGUF's own chat template, not Ollama's Go template", name)
    return model


def map_params(params: dict[str, Any], name: str) -> tuple[dict[str, Any], int | None]:
    """(sampling defaults, context length) from an Ollama params layer."""
    defaults: dict[str, Any] = {}
    context_length = None
    ignored = []
    for key, value in params.items():
        if key in _SAMPLING_PARAMS:
            defaults[_SAMPLING_PARAMS[key]] = value
        elif key == "num_ctx":
            context_length = int(value)
        else:
            ignored.append(key)
    if defaults.get("max_tokens") is not None and defaults["max_tokens"] < 0:
        del defaults["max_tokens"]  # Ollama's -1 / -2: until the context is full
    if isinstance(defaults.get("stop"), str):
        defaults["stop"] = [defaults["stop"]]
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"the Ollama model {name!r} has a parameter pagedllm cannot use: {error}"
        ) from error
    if ignored:
        logger.info("%s: Ollama parameters with no pagedllm equivalent: %s", name, ignored)
    return defaults, context_length


def _blob(layer: dict, name: str) -> tuple[Path, str]:
    digest = str(layer.get("digest", ""))
    algorithm, _, hex_digest = digest.partition(":")
    if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", hex_digest):
        raise ValueError(f"the Ollama model {name!r} names a layer by a bad digest {digest!r}")
    path = models_dir() / "blobs" / f"sha256-{hex_digest}"
    if not path.is_file():
        raise ValueError(
            f"the Ollama model {name!r} is missing its blob {path} (pull it again with "
            f"`ollama pull {name}`)"
        )
    return path, hex_digest
