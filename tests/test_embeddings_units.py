"""The parts of embeddings that need no model: reading sentence-transformers' pooling files,
per-request settings, the pooling arithmetic over chunks, and the CPU share an embedding
engine leaves to generation."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pagedllm_integrations.engine import cpu_share
from pagedllm_integrations.engine.pooling import (
    PoolingParams,
    PoolingState,
    check_dimensions,
    pool_step,
    read_pooler_config,
)

ST = "sentence_transformers.models."


def st_folder(tmp_path: Path, pooling: dict, extra: tuple[str, ...] = ("Normalize",)) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}]  # fmt: skip
    modules += [{"idx": 2 + i, "path": f"{2 + i}_{m}", "type": ST + m} for i, m in enumerate(extra)]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    return tmp_path


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    folder = st_folder(tmp_path, {"pooling_mode_mean_tokens": True})
    config = read_pooler_config(folder, {}, causal=False, override=None)
    assert (config.pooling_type, config.normalize, config.max_seq_length) == ("mean", True, 128)
    override = {"pooling_type": "CLS", "normalize": False}
    config = read_pooler_config(folder, {}, causal=False, override=override)
    assert (config.pooling_type, config.normalize) == ("cls", False)


def test_pooler_config_defaults_without_files(tmp_path):
    assert read_pooler_config(tmp_path, {}, causal=False, override=None).pooling_type == "cls"
    decoder = read_pooler_config(tmp_path, {}, causal=True, override=None)
    assert (decoder.pooling_type, decoder.normalize) == ("last", True)


@pytest.mark.parametrize(
    "pooling, extra, message",
    [
        ({"pooling_mode_max_tokens": True}, (), "pooling_mode_max_tokens"),
        ({"pooling_mode_mean_tokens": True}, ("LayerNorm",), "LayerNorm"),
        ({"pooling_mode_mean_tokens": True}, ("Dense",), "2_Dense/config.json is missing"),
        ({"pooling_mode": "max"}, (), r"\['max'\] is not supported"),
        ({"pooling_mode_lasttoken": True, "include_prompt": False}, (), "include_prompt"),
    ],
)
def test_unsupported_sentence_transformers_setups_are_refused(tmp_path, pooling, extra, message):
    with pytest.raises(ValueError, match=message):
        read_pooler_config(st_folder(tmp_path, pooling, extra), {}, causal=False, override=None)


def _dense(folder: Path, name: str, out: int, into: int, activation: str, bias: bool) -> None:
    from safetensors.torch import save_file

    (folder / name).mkdir()
    settings = {"in_features": into, "out_features": out, "bias": bias,
                "activation_function": f"torch.nn.modules.{activation}"}  # fmt: skip
    (folder / name / "config.json").write_text(json.dumps(settings))
    tensors = {"linear.weight": torch.randn(out, into)}
    if bias:
        tensors["linear.bias"] = torch.randn(out)
    save_file(tensors, str(folder / name / "model.safetensors"))


def test_dense_modules_after_pooling(tmp_path):
    """Dense projections (EmbeddingGemma's two; sentence-transformers' default activation
    is Tanh) run on the pooled vector, in order, before Normalize; the embedding's length
    is the last one's; sentence-transformers 6's names (module types under a longer
    namespace, `pooling_mode`) read as the older ones."""
    modules = [
        {"path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling"},
        {"path": "2_Dense", "type": "sentence_transformers.base.modules.dense.Dense"},
        {"path": "3_Dense", "type": "sentence_transformers.models.Dense"},
        {"path": "4_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "mean"}))
    _dense(tmp_path, "2_Dense", 12, 8, "activation.Tanh", bias=True)
    _dense(tmp_path, "3_Dense", 6, 12, "linear.Identity", bias=False)
    config = read_pooler_config(tmp_path, {}, causal=False, override=None)
    assert config.describe().startswith("mean pooling, Dense 8->12, Dense 12->6, normalized")
    assert config.embedding_size(8) == 6
    first, second = config.dense
    state = PoolingState(PoolingParams(), "mean", True, config.dense)
    rows = torch.randn(3, 8)
    state.add(rows.sum(0), 3)
    pooled = rows.mean(0)
    want = F.normalize(second.weight @ torch.tanh(first.weight @ pooled + first.bias), dim=-1)
    assert torch.allclose(state.finish(3), want, atol=1e-6)
    # sizes that do not chain, an activation it has no kernel for
    _dense(tmp_path, "5_Dense", 6, 7, "linear.Identity", bias=False)
    modules.insert(4, {"path": "5_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="do not chain"):
        read_pooler_config(tmp_path, {}, causal=False, override=None)
    settings = json.loads((tmp_path / "5_Dense" / "config.json").read_text())
    settings.update(in_features=6, activation_function="torch.nn.modules.activation.GELU")
    (tmp_path / "5_Dense" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="GELU"):
        read_pooler_config(tmp_path, {}, causal=False, override=None)


def test_pooler_config_override_errors(tmp_path):
    with pytest.raises(ValueError, match="not known"):
        read_pooler_config(tmp_path, {}, False, {"pooling": "mean"})
    with pytest.raises(ValueError, match="normalize"):
        read_pooler_config(tmp_path, {}, False, {"normalize": "yes"})


def test_pooling_params_and_dimensions():
    for bad in (dict(dimensions=0), dict(dimensions=True), dict(normalize=1), dict(truncate=None)):
        with pytest.raises(ValueError):
            PoolingParams(**bad)
    config = read_pooler_config(
        Path("/nonexistent"), {"matryoshka_dimensions": [64, 128]}, False, None
    )
    check_dimensions(PoolingParams(dimensions=64), config, 256, "m")
    check_dimensions(PoolingParams(dimensions=256), config, 256, "m")  # the full size
    with pytest.raises(ValueError, match="not one m supports"):
        check_dimensions(PoolingParams(dimensions=100), config, 256, "m")


@pytest.mark.parametrize("kind", ["mean", "cls", "last"])
def test_pooling_over_chunks_equals_pooling_at_once(kind):
    """A prompt of 7 rows pooled over chunks of 3, 3, 1 gives what the whole gives."""
    torch.manual_seed(0)
    hidden = torch.randn(7, 8)
    whole = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[kind]
    params = PoolingParams(dimensions=5)
    state = PoolingState(params, kind, normalize=True)
    request = SimpleNamespace(pooling=state, num_tokens=7)
    start = 0
    for size in (3, 3, 1):
        item = SimpleNamespace(
            request=request, num_tokens=size, start=start, completes_prompt=start + size == 7
        )
        other = SimpleNamespace(request=SimpleNamespace(pooling=None), num_tokens=2)
        rows = torch.cat([torch.zeros(2, 8), hidden[start : start + size]])
        for index, (part, count) in pool_step(rows, [other, item]).items():
            assert index == 1
            state.add(part, count)
        start += size
    want = torch.nn.functional.normalize(whole[:5], dim=-1)
    assert torch.allclose(state.finish(7), want, atol=1e-6)


def test_embedding_engines_yield_only_while_generation_runs():
    generation = object()
    assert cpu_share.pause_after(0.2, 0.25) == 0.0  # nobody generates: no pause
    cpu_share.mark_generating(generation, True)
    try:
        assert cpu_share.pause_after(0.2, 0.25) == pytest.approx(0.6)  # 0.2 of every 0.8 s
        assert cpu_share.pause_after(0.2, 1.0) == 0.0
    finally:
        cpu_share.mark_generating(generation, False)
    assert not cpu_share.generation_running()
