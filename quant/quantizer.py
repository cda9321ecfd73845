"""AWQ quantizer for the Llama family: transformers model in, AutoAWQ gemm checkpoint out.

transformers' own LlamaForCausalLM (or Mistral/Qwen2/Qwen3) is the calibration vehicle: it is an
independent implementation of the model, so the engine that later loads the checkpoint is
tested against it. Layer by layer:

    inputs of layer i (from the full-precision layer i-1, as AutoAWQ does)
      -> record the inputs of q_proj, o_proj, gate_proj, down_proj
      -> scale search + folding:  input_norm -> q,k,v    (block: attention)
                                  v -> o  (only without GQA: v's rows must match o's inputs)
                                  post_norm -> gate,up   (block: MLP)
                                  up -> down             (block: down_proj)
      -> clip search (not q/k), then group-wise INT4 min-max; the layer keeps the dequantized
         weights, so the model in memory computes what the checkpoint will.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .awq_format import AWQConfig, QuantizedWeight, is_excluded, quantize_weight
from .awq_search import apply_clip, apply_scales, sample_tokens, search_clip, search_scales

logger = logging.getLogger(__name__)

# The default calibration text of `pagedllm quantize` (installed with this package).
DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"

LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# Which recorded input each linear reads (q/k/v share one, gate/up share one).
_INPUT_OF = {
    "self_attn.q_proj": "self_attn.q_proj",
    "self_attn.k_proj": "self_attn.q_proj",
    "self_attn.v_proj": "self_attn.q_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj",
    "mlp.up_proj": "mlp.gate_proj",
    "mlp.down_proj": "mlp.down_proj",
}
_NO_CLIP = ("q_proj", "k_proj")  # attention scores are sensitive to clipped q/k outliers


@dataclass(slots=True)
class QuantizeOptions:
    group_size: int = 64
    num_samples: int = 64  # calibration blocks
    seq_len: int = 256  # tokens per block
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    clip_max_tokens: int = 512
    search_samples: int | None = 16  # blocks used in the scale search loss (None: all)
    modules_to_not_convert: list[str] = field(default_factory=list)
    progress: bool = True


@dataclass(slots=True)
class QuantizeReport:
    seconds: float
    seconds_per_layer: list[float]
    ratios: dict[str, float]  # "layer.group" -> chosen α (-1: no scaling)


class _Stop(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for layer 0 to record what the model passes to its decoder layers."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        if hasattr(layer, "attention_type"):  # Qwen2/Mistral pick a mask by layer type
            self.attention_type = layer.attention_type
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}

    def forward(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs
        raise _Stop


def calibration_blocks(
    tokenizer, texts: Sequence[str], num_samples: int, seq_len: int
) -> torch.Tensor:
    """Concatenate the tokenized texts and cut [num_samples, seq_len] blocks (int64)."""
    ids: list[int] = []
    for text in texts:
        if text.strip():
            ids.extend(tokenizer(text.strip() + "\n\n", add_special_tokens=False).input_ids)
    available = len(ids) // seq_len
    if available == 0:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens, fewer than one block of "
            f"seq_len={seq_len}; give more text or a smaller --seq-len"
        )
    if available < num_samples:
        logger.warning(
            "calibration text gives %d blocks of %d tokens, not %d", available, seq_len, num_samples
        )
    count = min(available, num_samples)
    return torch.tensor(ids[: count * seq_len], dtype=torch.int64).view(count, seq_len)


def _decoder_layers(model: nn.Module) -> Any:
    """A transformers causal LM's decoder layers (`model.model.layers`, a ModuleList)."""
    return model.model.layers  # type: ignore[union-attr]  # nn.Module attributes are untyped


def _layer_call(layer: nn.Module, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _decoder_inputs(model: nn.Module, blocks: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    """Hidden states entering layer 0 [n, L, H] and the kwargs every layer receives."""
    layers = _decoder_layers(model)
    catcher = _Catcher(layers[0])
    layers[0] = catcher
    try:
        model(blocks, use_cache=False)
    except _Stop:
        pass
    finally:
        layers[0] = catcher.layer
    hidden = catcher.args[0] if catcher.args else catcher.kwargs.pop("hidden_states")
    kwargs = {k: v for k, v in catcher.kwargs.items() if k != "hidden_states"}
    kwargs["use_cache"] = False
    for key in ("past_key_values", "past_key_value", "cache"):
        kwargs.pop(key, None)
    return hidden, kwargs


@torch.no_grad()
def awq_quantize_model(
    model: nn.Module, blocks: torch.Tensor, options: QuantizeOptions
) -> tuple[dict[str, QuantizedWeight], QuantizeReport]:
    """Quantize a transformers Llama-family model in place (float32 recommended).

    Returns {"model.layers.i.self_attn.q_proj": QuantizedWeight, ...}; every quantized
    linear of `model` then holds exactly its dequantized weight.
    """
    started = time.perf_counter()
    model.eval()
    hidden, kwargs = _decoder_inputs(model, blocks)
    group = options.group_size
    n_search = blocks.shape[0] if options.search_samples is None else options.search_samples
    quantized: dict[str, QuantizedWeight] = {}
    ratios: dict[str, float] = {}
    per_layer: list[float] = []
    layers = _decoder_layers(model)
    for index in tqdm(range(len(layers)), desc="AWQ", disable=not options.progress):
        t0 = time.perf_counter()
        layer = layers[index]
        linears = {name: layer.get_submodule(name) for name in LINEAR_NAMES}
        for name, lin in linears.items():
            if lin.in_features % group:
                raise ValueError(
                    f"group size {group} does not divide {name}.in_features={lin.in_features}; "
                    "choose a group size that divides hidden_size and intermediate_size"
                )
        feats = _record_inputs(layer, linears, hidden, kwargs)
        next_hidden = feats.pop("_out")
        prefix = f"model.layers.{index}"
        quantize_mask = {n: not is_excluded(n, options.modules_to_not_convert) for n in linears}
        search_kwargs = _slice_kwargs(kwargs, n_search, hidden.shape[0])
        attn, mlp = layer.self_attn, layer.mlp

        def attention_block(x: torch.Tensor, attn=attn, kw=search_kwargs) -> torch.Tensor:
            out = attn(hidden_states=x, **kw)
            return out[0] if isinstance(out, tuple) else out

        groups: list[tuple[str, nn.Module, list[str], str, Callable]] = [
            (
                "qkv",
                layer.input_layernorm,
                list(LINEAR_NAMES[:3]),
                "self_attn.q_proj",
                attention_block,
            ),
        ]
        v, o = linears["self_attn.v_proj"], linears["self_attn.o_proj"]
        if v.out_features == o.in_features:  # no GQA: v's output rows are o's input channels
            groups.append(("vo", v, ["self_attn.o_proj"], "self_attn.o_proj", o))
        groups.append(
            (
                "gate_up",
                layer.post_attention_layernorm,
                list(LINEAR_NAMES[4:6]),
                "mlp.gate_proj",
                mlp,
            )
        )
        groups.append(
            (
                "down",
                linears["mlp.up_proj"],
                ["mlp.down_proj"],
                "mlp.down_proj",
                linears["mlp.down_proj"],
            )
        )
        for tag, prev, names, input_name, block in groups:
            x = feats[input_name]
            if tag in ("qkv", "gate_up"):
                x_search = x[:n_search]  # whole sequences: attention mixes tokens
            else:
                x_search = sample_tokens(x, n_search * x.shape[1])
            members = [linears[n] for n in names]
            result = search_scales(
                members,
                [quantize_mask[n] for n in names],
                x_search,
                block,
                group,
                options.n_grid,
                options.duo_scaling,
            )
            ratios[f"{index}.{tag}"] = result.ratio
            logger.debug(
                "layer %d %s: alpha %.2f loss %.3g (round-to-nearest %.3g)",
                index,
                tag,
                result.ratio,
                result.loss,
                result.loss_unscaled,
            )
            if result.ratio >= 0:
                apply_scales(prev, members, result.scales)
                feats[input_name] = x / result.scales  # what the linears now receive
        for name, lin in linears.items():
            if not quantize_mask[name]:
                continue
            if options.clip and not any(key in name for key in _NO_CLIP):
                x = sample_tokens(feats[_INPUT_OF[name]], options.clip_max_tokens)
                apply_clip(lin, search_clip(lin.weight.data, x, group, options.n_grid), group)
            q = quantize_weight(lin.weight.data, group)
            quantized[f"{prefix}.{name}"] = q
            lin.weight.data = q.dequantize().to(lin.weight.dtype)
        hidden = next_hidden
        per_layer.append(time.perf_counter() - t0)
        del feats
    _round_dense_to_fp16(model, quantized)
    report = QuantizeReport(time.perf_counter() - started, per_layer, ratios)
    logger.info("AWQ quantized %d linears in %.1fs", len(quantized), report.seconds)
    return quantized, report


def _slice_kwargs(kwargs: dict[str, Any], n: int, total: int) -> dict[str, Any]:
    """Layer kwargs for the first n sequences: tensors with a batch dim of `total` are cut."""

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == total > 1:
            return value[:n]
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    return {key: cut(value) for key, value in kwargs.items()}


def _record_inputs(
    layer: nn.Module, linears: dict[str, nn.Linear], hidden: torch.Tensor, kwargs: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Inputs of q_proj, o_proj, gate_proj and down_proj ([n, L, K]) and the layer's output."""
    feats: dict[str, torch.Tensor] = {}
    handles = []
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):

        def hook(_module, inputs, _output, name=name):
            feats[name] = inputs[0].detach()

        handles.append(linears[name].register_forward_hook(hook))
    try:
        feats["_out"] = _layer_call(layer, hidden, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return feats


def _round_dense_to_fp16(model: nn.Module, quantized: dict[str, QuantizedWeight]) -> None:
    """The checkpoint stores every non-quantized tensor in fp16: make memory agree with it."""
    skip = {f"{name}.weight" for name in quantized}
    for name, param in model.named_parameters():
        if name not in skip:
            param.data = param.data.to(torch.float16).to(param.dtype)


@torch.no_grad()
def rtn_quantize_model(
    model: nn.Module, group_size: int, skip: Sequence[str] = ()
) -> dict[str, QuantizedWeight]:
    """Plain round-to-nearest INT4 of every decoder linear (the baseline AWQ must beat)."""
    quantized: dict[str, QuantizedWeight] = {}
    for index, layer in enumerate(_decoder_layers(model)):
        for name in LINEAR_NAMES:
            if is_excluded(name, list(skip)):
                continue
            lin = layer.get_submodule(name)
            q = quantize_weight(lin.weight.data, group_size)
            lin.weight.data = q.dequantize().to(lin.weight.dtype)
            quantized[f"model.layers.{index}.{name}"] = q
    _round_dense_to_fp16(model, quantized)
    return quantized


def save_awq_checkpoint(
    model: nn.Module,
    quantized: dict[str, QuantizedWeight],
    out: Path,
    config: AWQConfig,
    source_folder: Path,
    tokenizer=None,
) -> Path:
    """Write model.safetensors + config.json (+ tokenizer, generation config) in AutoAWQ gemm form."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw_config = json.loads((source_folder / "config.json").read_text())
    tied = bool(
        raw_config.get("tie_word_embeddings", getattr(model.config, "tie_word_embeddings", False))
    )
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in quantized and name.endswith(".weight"):
            for suffix, packed in quantized[module].pack().items():
                tensors[f"{module}.{suffix}"] = packed.contiguous()
            continue
        if name == "lm_head.weight" and tied:
            continue  # AutoAWQ leaves a tied head out; loaders tie it to the embeddings
        if "rotary_emb" in name:
            continue
        tensors[name] = tensor.detach().to(torch.float16).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw_config["quantization_config"] = config.to_hf_dict()
    raw_config["torch_dtype"] = "float16"
    raw_config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    for name in ("generation_config.json", "tokenizer.model"):
        if (source_folder / name).exists() and not (out / name).exists():
            shutil.copy(source_folder / name, out / name)
    return out
