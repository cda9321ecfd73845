"""Embeddings: how a prompt's hidden states become one vector, per model and per request.

    PoolerConfig   per model: the pooling (mean, CLS, last token), the Dense projections
                   after it (EmbeddingGemma's two) and whether vectors are scaled to unit
                   length; read from the model's sentence-transformers files (modules.json,
                   1_Pooling/config.json, N_Dense/), overridable by `pooler_config`.
    PoolingParams  per request: normalize, Matryoshka `dimensions`, `truncate`.
    PoolingState   per request in flight: what the chunks computed so far add up to (a
                   decoder's prompt may run over several steps; an encoder's runs in one).

Without sentence-transformers files, an encoder (BERT) pools its CLS row and a decoder its
last row, both normalized: what vLLM does for such models.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

POOLING_TYPES = ("mean", "cls", "last")
# sentence-transformers' Pooling config flag -> our pooling type
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
# sentence-transformers 6 writes {"pooling_mode": "mean"} instead of the flags above
_ST6_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_UNSUPPORTED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
# sentence-transformers' Dense activations (its default is Tanh) -> the function applied to
# a projected vector (None: none)
_DENSE_ACTIVATIONS = {
    "Identity": None,
    "Tanh": torch.tanh,
}


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a model turns hidden states into an embedding."""

    pooling_type: str  # mean | cls | last
    normalize: bool  # unit length (cosine similarity = dot product)
    source: str  # where it came from, for the load log line
    max_seq_length: int | None = None  # sentence-transformers' limit (sentence_bert_config)
    # Matryoshka: None = `dimensions` refused; () = any size up to the full one; else the list
    matryoshka_dimensions: tuple[int, ...] | None = None
    dense: tuple[DenseLayer, ...] = ()  # applied in order to the pooled vector

    def describe(self) -> str:
        norm = "normalized" if self.normalize else "not normalized"
        dense = "".join(f", Dense {d.in_features}->{d.out_features}" for d in self.dense)
        return f"{self.pooling_type} pooling{dense}, {norm} ({self.source})"

    def embedding_size(self, hidden: int) -> int:
        """The length of a full embedding of a model `hidden` wide."""
        return self.dense[-1].out_features if self.dense else hidden


@dataclass(frozen=True, slots=True, eq=False)
class DenseLayer:
    """A sentence-transformers Dense module: vector -> activation(weight @ vector + bias)."""

    weight: torch.Tensor = field(repr=False)  # float32 [out_features, in_features]
    bias: torch.Tensor | None = field(repr=False)  # float32 [out_features]
    activation: str = "Identity"  # a key of _DENSE_ACTIVATIONS

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(vector, self.weight, self.bias)
        act = _DENSE_ACTIVATIONS[self.activation]
        return out if act is None else act(out)


def read_pooler_config(
    folder: Path, hf_config: dict[str, Any], causal: bool, override: dict[str, Any] | None
) -> PoolerConfig:
    """The model's pooling: sentence-transformers' files in `folder` where present, else the
    default for its kind; `override` (EngineConfig.pooler_config) wins key by key."""
    pooling, normalize, source = ("last" if causal else "cls"), True, "default for the model type"
    max_seq_length = None
    dense: tuple[DenseLayer, ...] = ()
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        pooling, normalize, dense = _from_modules(folder, modules)
        source = "sentence-transformers modules.json"
        settings = _read_json(folder / "sentence_bert_config.json") or {}
        if isinstance(settings.get("max_seq_length"), int):
            max_seq_length = int(settings["max_seq_length"])
    if override:
        unknown = sorted(set(override) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(
                f"pooler_config keys {unknown} are not known: give pooling_type "
                f"({', '.join(POOLING_TYPES)}) and/or normalize (bool)"
            )
        if "pooling_type" in override:
            pooling = check_pooling_type(override["pooling_type"])
        if "normalize" in override:
            if not isinstance(override["normalize"], bool):
                raise ValueError(
                    f"pooler_config['normalize'] must be True or False, got {override['normalize']!r}"
                )
            normalize = override["normalize"]
        source = f"pooler_config over {source}"
    return PoolerConfig(pooling, normalize, source, max_seq_length, _matryoshka(hf_config), dense)


def check_pooling_type(value: Any) -> str:
    name = str(value).lower().removesuffix("_token").removesuffix("token")
    name = {"mean_tokens": "mean", "lasttoken": "last"}.get(name, name)
    if name not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
    return name


def _from_modules(
    folder: Path, modules: list[dict[str, Any]]
) -> tuple[str, bool, tuple[DenseLayer, ...]]:
    pooling: str | None = None
    normalize = False
    dense: list[DenseLayer] = []
    for module in modules:
        # sentence_transformers.models.Pooling, or (sentence-transformers 6)
        # sentence_transformers.sentence_transformer.modules.pooling.Pooling
        kind = str(module.get("type", "")).rpartition(".")[2]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer" and not dense and pooling is None:
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling" and pooling is None:
            pooling = _pooling_mode(path / "config.json")
        elif kind == "Dense" and pooling is not None and not normalize:
            dense.append(_dense_layer(path))
        else:  # LayerNorm, WordEmbeddings, ..., or the modules in another order
            raise ValueError(
                f"{folder}: the sentence-transformers module {module.get('type')!r} "
                f"({module.get('path')}) is not supported where it is; pagedllm runs "
                "Transformer -> Pooling -> Dense (any number) -> Normalize"
            )
    if pooling is None:
        raise ValueError(f"{folder}/modules.json has no Pooling module")
    widths = [(a.out_features, b.in_features) for a, b in itertools.pairwise(dense)]
    if any(out != into for out, into in widths):
        raise ValueError(f"{folder}: the Dense modules' sizes do not chain: {widths}")
    return pooling, normalize, tuple(dense)


def _dense_layer(path: Path) -> DenseLayer:
    """A Dense module's folder: config.json (in_features, out_features, bias,
    activation_function) and its `linear.weight` / `linear.bias` in model.safetensors (or
    pytorch_model.bin, as older sentence-transformers wrote it)."""
    settings = _read_json(path / "config.json")
    if not isinstance(settings, dict):
        raise ValueError(f"{path}/config.json is missing or not a JSON object")
    activation = str(settings.get("activation_function", "torch.nn.modules.activation.Tanh"))
    activation = activation.rpartition(".")[2]
    if activation not in _DENSE_ACTIVATIONS:
        raise ValueError(
            f"{path}: Dense activation {settings.get('activation_function')!r} is not "
            f"supported ({', '.join(_DENSE_ACTIVATIONS)})"
        )
    if (path / "model.safetensors").exists():
        from safetensors.torch import load_file

        tensors = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").exists():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path} holds no weights (model.safetensors or pytorch_model.bin)")
    weight = tensors.get("linear.weight")
    shape = (int(settings.get("out_features", -1)), int(settings.get("in_features", -1)))
    if weight is None or tuple(weight.shape) != shape:
        raise ValueError(
            f"{path}: linear.weight is {None if weight is None else tuple(weight.shape)}, its "
            f"config says [out_features, in_features] = {list(shape)}"
        )
    bias = tensors.get("linear.bias") if settings.get("bias", True) else None
    return DenseLayer(
        weight.float().contiguous(),
        None if bias is None else bias.float().contiguous(),
        activation,
    )


def _pooling_mode(path: Path) -> str:
    settings = _read_json(path)
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is missing or not a JSON object")
    unsupported = [key for key in _ST_UNSUPPORTED if settings.get(key)]
    modes = [mode for key, mode in _ST_MODES.items() if settings.get(key)]
    named = settings.get("pooling_mode")  # sentence-transformers 6: one name, or several
    for name in [named] if isinstance(named, str) else named or []:
        if name in _ST6_MODES:
            modes.append(_ST6_MODES[name])
        else:
            unsupported.append(str(name))
    if unsupported or len(modes) != 1:
        raise ValueError(
            f"{path}: pooling {unsupported + modes or 'none'} is not supported; pagedllm "
            "pools with exactly one of mean, cls, lasttoken"
        )
    if settings.get("include_prompt") is False:
        raise ValueError(
            f"{path}: include_prompt=false (instruction-excluded pooling) is not supported"
        )
    return modes[0]


def _matryoshka(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(sorted(int(d) for d in dims))
    return () if hf_config.get("is_matryoshka") else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} could not be read: {error}") from error


# ----------------------------------------------------------------- per request
@dataclass(frozen=True, slots=True)
class PoolingParams:
    """Per-request embedding settings (vLLM's PoolingParams, for embeddings).

    normalize: scale to unit length; None = the model's setting.
    dimensions: keep the first `dimensions` values (Matryoshka models only), then normalize.
    truncate: cut a prompt longer than the model's limit instead of refusing it (text keeps
        its first tokens and the tokenizer's closing special token; token ids their first).
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate: bool = False

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool)
            or not isinstance(self.dimensions, int)
            or self.dimensions < 1
        ):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"truncate must be True or False, got {self.truncate!r}")


def check_dimensions(params: PoolingParams, config: PoolerConfig, hidden: int, name: str) -> None:
    """ValueError unless `params.dimensions` is a size this model's embeddings can be cut to."""
    dims = params.dimensions
    if dims is None or dims == hidden:
        return
    allowed = config.matryoshka_dimensions
    if allowed is None:
        raise ValueError(
            f"dimensions={dims}: {name} is not a Matryoshka model (its config.json has no "
            f"matryoshka_dimensions or is_matryoshka), so its {hidden}-value embeddings cannot "
            "be shortened; leave dimensions unset"
        )
    if dims > hidden or (allowed and dims not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1..{hidden}"
        raise ValueError(f"dimensions={dims} is not one {name} supports ({sizes})")


@dataclass(slots=True)
class PoolingState:
    """A pooling request's partial result over the steps its prompt ran in."""

    params: PoolingParams
    pooling_type: str
    normalize: bool
    dense: tuple[DenseLayer, ...] = ()  # the model's projections after pooling
    total: torch.Tensor | None = None  # float32 [hidden]: the sum (mean), the row (cls, last)
    rows: int = 0
    result: torch.Tensor | None = field(default=None, repr=False)

    @property
    def reads_prefix_cache(self) -> bool:
        """Only last-token pooling may skip rows a prefix-cache hit spares (a decoder's):
        mean needs every row's hidden state and CLS the first."""
        return self.pooling_type == "last"

    def reset(self) -> None:
        """Forget the rows pooled so far (the request is recomputed after preemption)."""
        self.total, self.rows = None, 0

    def add(self, part: torch.Tensor, rows: int) -> None:
        if self.pooling_type == "mean":
            self.total = part if self.total is None else self.total + part
        else:
            self.total = part
        self.rows += rows

    def finish(self, num_tokens: int) -> torch.Tensor:
        assert self.total is not None, "a pooling request finished without its rows"
        vector = self.total / num_tokens if self.pooling_type == "mean" else self.total
        for layer in self.dense:
            vector = layer(vector)
        if self.params.dimensions is not None:
            vector = vector[: self.params.dimensions]
        normalize = self.normalize if self.params.normalize is None else self.params.normalize
        if normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        self.result = vector.contiguous()
        return self.result


# {index of a scheduled request: (float32 [hidden] part of its embedding, rows it covers)}
PooledParts = dict[int, tuple[torch.Tensor, int]]


def pool_step(hidden: torch.Tensor, scheduled: list[Any]) -> PooledParts:
    """What this step adds to each pooling request: {index in scheduled: (float32 [hidden]
    part, rows)}. hidden [T, hidden] holds the step's rows in the order of `scheduled`
    (engine/scheduler.py's ScheduledRequest: num_tokens rows from position start)."""
    parts: PooledParts = {}
    offset = 0
    for index, item in enumerate(scheduled):
        begin, offset = offset, offset + item.num_tokens
        state = item.request.pooling
        if state is None:
            continue
        if state.pooling_type == "mean":
            parts[index] = (hidden[begin:offset].float().sum(0), item.num_tokens)
        elif state.pooling_type == "cls":
            if item.start == 0:
                parts[index] = (hidden[begin].float().clone(), item.num_tokens)
        elif item.completes_prompt:  # last
            parts[index] = (hidden[offset - 1].float().clone(), item.num_tokens)
    return parts
