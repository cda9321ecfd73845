"""Where one decode step of the CPU fast path goes: each kernel of the decoder stack timed
alone over all the model's layers, the whole fused stack, and the LM head.

    python benchmarks/cpu_decode_step.py                 # 16 and 64 sequences x 192 keys
    python benchmarks/cpu_decode_step.py --rows 64 --keys 192 --repeat 9
    python benchmarks/cpu_decode_step.py --verify --rows 1,4,5 --keys 1000   # speculation
    python benchmarks/cpu_decode_step.py --model model.gguf --rows 1 --keys 256  # any model

The model is the embedded SmolLM2-135M-Instruct GGUF (or `--model`) with the engine's
defaults (packed linears, bf16 KV cache); each linear's weights-read rate is printed too
(what bounds a step of one or a few rows). Each of `--rows` sequences decodes one token
with `--keys` keys in the cache, its blocks laid out one sequence after another. With
`--verify`, the `--rows` are the query rows of one sequence instead, a step verifying
`rows - 1` drafted tokens (prompt lookup) at `--keys` keys: what each row past the first
costs. Every figure is the best of `--repeat` timings. The baseline, timed in the same
run, is the torch reference attention (kernels/reference.py: gather the blocks, then
SDPA) over the same keys and values in its own cache layout; the script prints the fast
path's attention against it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16


def best_of(repeat: int, fn) -> float:
    fn()  # warm: buffers grown, caches hot as in a running engine
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _bytes(weight) -> int:
    """Bytes a linear or table reads per call (packed tiles and their scales, or bf16)."""
    if hasattr(weight, "weight_bytes"):
        return int(weight.weight_bytes())
    if hasattr(weight, "nbytes"):
        return int(weight.nbytes)
    return 0


def measure(llm, rows: int, keys: int, repeat: int, verify: bool = False) -> dict:
    from pagedllm_integrations.engine.attention_metadata import AttentionMetadata
    from pagedllm_integrations.engine.models.fused_stack import _norm_scale
    from pagedllm_integrations.engine.white_box import core_of
    from pagedllm_integrations.kernels import reference

    engine = core_of(llm)
    model = engine.executor.model
    stack = model.fused_stack()
    if stack is None:
        raise SystemExit(f"the fused CPU stack is off here: {model.stack_status()}")
    caches = engine.executor.runner.kv_caches  # per layer (one table: see main's LLM)
    ops = torch.ops.pagedllm
    hidden, layers = model.config.hidden_size, list(model.layers)
    attn0 = layers[0].self_attn
    heads, kv_heads, head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
    per_seq = -(-keys // BLOCK)
    sequences = 1 if verify else rows
    if sequences * per_seq > caches[0][0].shape[0]:
        raise SystemExit(f"{sequences} x {keys} keys do not fit the KV cache")
    tables = torch.arange(sequences * per_seq, dtype=torch.int32).view(sequences, per_seq)
    seq_lens = torch.full((sequences,), keys, dtype=torch.int32)
    if verify:  # one sequence's rows at positions keys - rows .. keys - 1
        cu = torch.tensor([0, rows], dtype=torch.int32)
        positions = torch.arange(keys - rows, keys, dtype=torch.long)
        slots = positions.clone()  # its blocks are 0, 1, ...: slot = position
    else:  # one row per sequence, at position keys - 1
        cu = torch.arange(rows + 1, dtype=torch.int32)
        positions = torch.full((rows,), keys - 1, dtype=torch.long)
        slots = (tables[:, -1].long() * BLOCK + (keys - 1) % BLOCK).contiguous()
    x = torch.randn(rows, hidden)
    for k_cache, v_cache in caches:  # keys and values of the right scale, not zeros
        k_cache.copy_(torch.randn(k_cache.shape) * 0.5)
        v_cache.copy_(torch.randn(v_cache.shape) * 0.5)

    # Each layer's C++ linears (the stack's own objects) and the module that holds them.
    def linears(name: str) -> list[tuple]:
        found = []
        for layer in layers:
            module = {
                "qkv": layer.self_attn.qkv_proj,
                "o": layer.self_attn.o_proj,
                "gate_up": getattr(layer.mlp, "gate_up_proj", None),
                "down": getattr(layer.mlp, "down_proj", None),
            }[name]
            if module is None:  # a mixture of experts: timed whole, below
                return []
            found.append((module.kernel_linear(), module))
        return found

    h = torch.randn(rows, hidden)
    # Looked up once: the timed loops below run the kernels, not the walk over the layers.
    qkv, o, gate_up, down = (linears(name) for name in ("qkv", "o", "gate_up", "down"))
    qkv_out = ops.linear(qkv[0][0], h)
    q = qkv_out[:, : heads * head_dim].reshape(rows, heads, head_dim).contiguous()
    k = qkv_out[:, heads * head_dim : (heads + kv_heads) * head_dim]
    k = k.reshape(rows, kv_heads, head_dim).contiguous()
    v = k.clone()
    attn_out = torch.empty(rows, heads, head_dim)
    cos, sin = attn0.rotary.half_tables()
    gelu = bool(getattr(layers[0].mlp, "gelu", False))
    act = ops.gated_linear(gate_up[0][0], h, gelu) if gate_up else None
    seq_ids = torch.arange(sequences)
    residual = torch.randn(rows, hidden)  # add_rms_norm adds into it
    norm_scales = [
        _norm_scale(getattr(layer, name))
        for layer in layers
        for name in ("input_layernorm", "post_attention_layernorm")
    ]
    eps = float(layers[0].input_layernorm.eps)
    parts = {
        "norms": lambda: [ops.add_rms_norm(x, residual, w, eps) for w in norm_scales],
        "qkv": lambda: [ops.linear(lin, h) for lin, _ in qkv],
        "rotary": lambda: [ops.rotary_neox_(q, k, positions, cos, sin) for _ in caches],
        "kv write": lambda: [ops.write_kv_cache_(k, v, kc, vc, slots) for kc, vc in caches],
        "attention": lambda: [
            ops.paged_attention_rows_(
                q, kc, vc, attn_out, seq_ids, cu, seq_lens, tables, float(attn0.scale), 0, 0.0
            )
            for kc, vc in caches
        ],
        "o": lambda: [ops.linear(lin, attn_out.view(rows, -1)) for lin, _ in o],
    }
    if gate_up:
        parts["gate_up + act"] = lambda: [ops.gated_linear(lin, h, gelu) for lin, _ in gate_up]
        parts["down"] = lambda: [ops.linear(lin, act) for lin, _ in down]
    result = {name: best_of(repeat, fn) * 1e3 for name, fn in parts.items()}
    # The same attention without the software prefetch of the next chunk (attention.cpp):
    # what it gains, with the same bits.
    was = ops.set_attention_prefetch(False)
    try:
        result["attention, no prefetch"] = best_of(repeat, parts["attention"]) * 1e3
    finally:
        ops.set_attention_prefetch(was)

    meta = AttentionMetadata(
        slot_mapping=slots, cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables,
        max_seqlen_q=rows if sequences == 1 else 1, max_seqlen_k=keys, backend="cpu",
    )  # fmt: skip
    result["whole stack"] = best_of(repeat, lambda: stack(x, positions, caches, meta)) * 1e3
    result["lm head"] = best_of(repeat, lambda: model.compute_logits(h)) * 1e3

    # Each linear's rate of reading its weights (what bounds a step of few rows).
    rates = {}
    for name, found in (("qkv", qkv), ("o", o),
                        ("gate_up + act", gate_up), ("down", down)):  # fmt: skip
        total = sum(_bytes(module) for _, module in found)
        if total:
            rates[name] = total / (result[name] * 1e-3) / 1e9
    head_bytes = _bytes(model.lm_head.table.fast_weight)
    if head_bytes:
        rates["lm head"] = head_bytes / (result["lm head"] * 1e-3) / 1e9
    result["weights GB/s"] = rates

    # The baseline: the torch reference, keys and values in its [blocks, block, Hkv, D] layout.
    ref_caches = [
        (kc.permute(0, 3, 1, 2).contiguous(), vc.permute(0, 2, 1, 3).contiguous())
        for kc, vc in caches
    ]
    ref_out = torch.empty(rows, heads, head_dim)
    result["reference attention"] = (
        best_of(
            repeat,
            lambda: [
                reference.paged_attention(
                    q, kc, vc, ref_out, cu, seq_lens, tables, float(attn0.scale)
                )
                for kc, vc in ref_caches
            ],
        )
        * 1e3
    )
    kv_bytes = rows * keys * len(caches) * 2 * kv_heads * head_dim * caches[0][0].element_size()
    result["attention GB/s"] = kv_bytes / (result["attention"] * 1e-3) / 1e9
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,64", help="sequences decoding at once")
    parser.add_argument(
        "--verify", action="store_true", help="--rows are one sequence's rows (1 + drafts)"
    )
    parser.add_argument("--keys", type=int, default=192, help="keys in each sequence's cache")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--model", help="a GGUF file or folder (default: the embedded model)")
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "cpu_decode_step.json")
    )
    args = parser.parse_args()
    from pagedllm_integrations import LLM

    all_rows = [int(r) for r in args.rows.split(",")]
    blocks = (1 if args.verify else max(all_rows)) * -(-args.keys // BLOCK) + 1
    # One block table and a tensor pair per layer (a sliding-window model's default layout
    # shares pairs between layers, kv_layout.py): the kernels timed here are the same.
    llm = LLM(
        args.model, num_kv_blocks=blocks, max_model_len=args.keys + BLOCK,
        disable_log_stats=True, disable_hybrid_kv_cache_manager=True,
    )  # fmt: skip
    report = {"model": args.model or "default", "keys": args.keys,
              "threads": torch.get_num_threads(), "verify": args.verify}  # fmt: skip
    report["rows"] = {}
    for rows in all_rows:
        report["rows"][str(rows)] = measure(llm, rows, args.keys, args.repeat, args.verify)
    what = "rows of one sequence" if args.verify else "sequences"
    print(f"ms per decode step, all layers ({args.keys} keys per sequence; columns: {what})")
    first = report["rows"][str(all_rows[0])]
    names = [name for name, value in first.items() if not isinstance(value, dict)]
    print(f"{'':>24}" + "".join(f"{f'{r} rows':>12}" for r in all_rows))
    for name in names:
        print(f"{name:>24}" + "".join(f"{report['rows'][str(r)][name]:>12.2f}" for r in all_rows))
    print("weights read, GB/s (a linear's bytes over its time, all layers)")
    for name in first["weights GB/s"]:
        rates = [report["rows"][str(r)]["weights GB/s"][name] for r in all_rows]
        print(f"{name:>24}" + "".join(f"{rate:>12.1f}" for rate in rates))
    for rows in all_rows:
        r = report["rows"][str(rows)]
        ratio = r["reference attention"] / r["attention"]
        print(
            f"{rows} rows: in-place attention {ratio:.2f}x the torch reference's speed, "
            f"{r['attention, no prefetch'] / r['attention']:.2f}x its own without prefetch"
        )
    Path(args.json).write_text(json.dumps(report, indent=2))
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
