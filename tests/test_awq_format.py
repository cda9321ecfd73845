"""AWQ gemm format: packing against int32 values worked out by hand, dequantization, config."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm_integrations.quant.awq_format import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    dequantize,
    is_excluded,
    load_awq_config,
    pack_int4,
    parse_awq_config,
    quantize_weight,
    unpack_int4,
)

# Worked out by hand from the nibble order: nibble i (bits 4i..4i+3) holds column
# [0, 2, 4, 6, 1, 3, 5, 7][i]; the hex digits below are nibbles 7..0.
#   columns [0..7] = 0 1 2 3 4 5 6 7        -> nibbles 7..0 = 7 5 3 1 6 4 2 0
#   columns [0..7] = 8 9 10 11 12 13 14 15  -> nibbles 7..0 = F D B 9 E C A 8 (negative)
#   columns [0..7] = 15 0 0 0 0 0 0 15      -> nibbles 7..0 = F 0 0 0 0 0 0 F (negative)
ROW_0_TO_7 = 0x75316420  # = 1966171168
ROW_8_TO_15 = 0xFDB9ECA8 - (1 << 32)  # = -38146904 as an int32
ROW_EDGES = 0xF000000F - (1 << 32)  # = -268435441
ALL_ONES = 0x11111111
ALL_EIGHTS = 0x88888888 - (1 << 32)


def test_orders_are_inverse_permutations():
    assert [AWQ_ORDER[AWQ_REVERSE_ORDER[j]] for j in range(8)] == list(range(8))


def test_pack_matches_hand_computed_int32():
    codes = torch.tensor(
        [list(range(8)), list(range(8, 16)), [15, 0, 0, 0, 0, 0, 0, 15]], dtype=torch.int32
    )
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32
    assert packed[:, 0].tolist() == [ROW_0_TO_7, ROW_8_TO_15, ROW_EDGES]
    assert ROW_0_TO_7 == 1966171168 and ROW_8_TO_15 == -38146904


def test_unpack_hand_computed_int32_including_negative_words():
    packed = torch.tensor([[ROW_0_TO_7, ROW_8_TO_15], [ROW_EDGES, 0]], dtype=torch.int32)
    codes = unpack_int4(packed)
    assert codes.tolist() == [
        list(range(8)) + list(range(8, 16)),
        [15, 0, 0, 0, 0, 0, 0, 15] + [0] * 8,
    ]


def test_pack_unpack_round_trip_random():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 96), generator=gen, dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.full((1, 8), 16, dtype=torch.int32))


def test_dequantize_hand_made_vector():
    # K = 4, N = 8, G = 2: rows 0-1 use group 0 (zero 1, scale 0.5), rows 2-3 group 1
    # (zero 8, scales 1 for columns 0-3 and 2 for columns 4-7).
    qweight = torch.tensor([[ROW_0_TO_7], [ROW_0_TO_7], [ROW_8_TO_15], [0]], dtype=torch.int32)
    qzeros = torch.tensor([[ALL_ONES], [ALL_EIGHTS]], dtype=torch.int32)
    scales = torch.tensor([[0.5] * 8, [1.0] * 4 + [2.0] * 4], dtype=torch.float16)
    w = dequantize(qweight, qzeros, scales, group_size=2, dtype=torch.float32)
    expected = torch.tensor(
        [
            [-0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
            [-0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0],
            [0.0, 1.0, 2.0, 3.0, 8.0, 10.0, 12.0, 14.0],
            [-8.0, -8.0, -8.0, -8.0, -16.0, -16.0, -16.0, -16.0],
        ]
    )
    assert torch.equal(w, expected)
    assert dequantize(qweight, qzeros, scales, 2).dtype == torch.float16


def test_quantize_weight_matches_min_max_rule_and_packs_consistently():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 128, generator=gen)
    q = quantize_weight(weight, 64)
    assert q.codes.shape == (24, 128) and q.zeros.shape == (24, 2) and q.scales.shape == (24, 2)
    # Independent restatement of the rule for one group.
    group = weight[5, 64:]
    scale = ((group.max() - group.min()).clamp(min=1e-5) / 15).half().float()
    zero = (-torch.round(group.min() / scale)).clamp(0, 15)
    assert q.scales[5, 1].float() == scale and q.zeros[5, 1] == zero
    assert torch.equal(q.codes[5, 64:], (torch.round(group / scale) + zero).clamp(0, 15).int())
    # Error bounded by half a step (plus clamping at the ends of the range).
    err = (q.dequantize() - weight).abs().view(24, 2, 64)
    step = q.scales.float().unsqueeze(-1)
    assert bool((err <= step * 0.5 + 1e-6).float().mean() > 0.99)
    packed = q.pack()
    assert packed["qweight"].shape == (128, 3) and packed["qzeros"].shape == (2, 3)
    assert packed["scales"].shape == (2, 24) and packed["scales"].dtype == torch.float16
    w_t = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], 64, torch.float32)
    assert torch.equal(w_t.t(), q.dequantize())


def test_quantize_weight_rejects_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match="group size 128 must divide in_features 576"):
        quantize_weight(torch.randn(8, 576), 128)


def test_dequantize_matches_autoawq_reference():
    packing = pytest.importorskip("awq.utils.packing_utils")
    gen = torch.Generator().manual_seed(2)
    q = quantize_weight(torch.randn(64, 256, generator=gen), 64)
    t = q.pack()
    theirs = packing.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], 4, 64)
    ours = dequantize(t["qweight"], t["qzeros"], t["scales"], 64)  # fp16 like theirs
    assert torch.equal(ours, theirs)


# ------------------------------------------------------------------- config
def test_parse_autoawq_config_and_aliases():
    cfg = parse_awq_config(
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 64,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    )
    assert (cfg.bits, cfg.group_size, cfg.version, cfg.modules_to_not_convert) == (
        4,
        64,
        "gemm",
        [],
    )
    alias = parse_awq_config({"w_bit": 4, "q_group_size": 128, "version": "GEMM"})
    assert alias.group_size == 128 and alias.version == "gemm"
    assert parse_awq_config({"group_size": -1}).group_size_for(576) == 576
    assert cfg.to_hf_dict() == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"bits": 8}, "4-bit AWQ only"),
        ({"version": "gemv"}, "'gemv' is not supported"),
        ({"zero_point": False}, "zero_point"),
        ({"group_size": 12}, "multiple of 8"),
        ({"quant_method": "gptq"}, "not an AWQ config"),
    ],
)
def test_parse_rejects_unsupported(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_awq_config(raw)


def test_load_config_from_config_json_or_fallback_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert load_awq_config(tmp_path) is None
    (tmp_path / "quant_config.json").write_text(
        json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"})
    )
    assert load_awq_config(tmp_path).group_size == 32
    raw = {"quant_method": "awq", "bits": 4, "group_size": 64, "modules_to_not_convert": ["gate"]}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": raw}))
    cfg = load_awq_config(tmp_path)
    assert cfg.group_size == 64 and cfg.modules_to_not_convert == ["gate"]


def test_modules_to_not_convert_is_autoawq_substring_rule():
    assert is_excluded("mlp.gate_proj", ["gate"])  # AutoAWQ's Mixtral default also hits this
    assert is_excluded("self_attn.v_proj", ["v_proj"])
    assert not is_excluded("self_attn.q_proj", ["v_proj", "visual"])
    assert not is_excluded("mlp.down_proj", None)
