"""Where one decode step of the CPU fast path goes: each kernel of the decoder stack timed
alone over all the model's layers, the whole fused stack, and the LM head.

    python benchmarks/cpu_decode_step.py                 # 16 and 64 sequences x 192 keys
    python benchmarks/cpu_decode_step.py --rows 64 --keys 192 --repeat 9
    python benchmarks/cpu_decode_step.py --verify --rows 1,4,5 --keys 1000   # speculation

The model is the embedded SmolLM2-135M-Instruct GGUF with the engine's defaults (packed
int4 linears, bf16 KV cache). Each of `--rows` sequences decodes one token with `--keys`
keys in the cache, its blocks laid out one sequence after another. With `--verify`, the
`--rows` are the query rows of one sequence instead, a step verifying `rows - 1` drafted
tokens (prompt lookup) at `--keys` keys: what each row past the first costs. Every figure is the best
of `--repeat` timings. The baseline, timed in the same run, is the torch reference
attention (kernels/reference.py: gather the blocks, then SDPA) over the same keys and
values in its own cache layout; the script prints the fast path's attention against it.
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


def measure(llm, rows: int, keys: int, repeat: int, verify: bool = False) -> dict:
    from pagedllm_integrations.engine.white_box import core_of
    from pagedllm_integrations.kernels import reference

    engine = core_of(llm)
    model = engine.executor.model
    stack = model.fused_stack()
    if stack is None:
        raise SystemExit("the fused CPU stack is off here (no AVX-512 or AVX2, or no C++ kernels)")
    caches = engine.executor.kv_caches
    ops = torch.ops.pagedllm
    hidden, layers = model.config.hidden_size, len(caches)
    heads, kv_heads, head_dim = stack.heads, stack.kv_heads, stack.head_dim
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

    p, n = stack.params, stack.ints

    def linear(j: int, layer: int, inp: torch.Tensor) -> torch.Tensor:
        t = p[layer * 18 + 2 + 4 * j : layer * 18 + 6 + 4 * j]
        kind, group, width = n[layer * 13 + 3 * j : layer * 13 + 3 * j + 3]
        if kind == 1:
            return ops.u4_tiled_linear(inp, t[0], t[1], t[2], width)
        if kind == 2:
            return ops.i8_tiled_linear(inp, t[0], t[1], t[2], group, width)
        return ops.bf16_linear(inp, t[0])

    h = torch.randn(rows, hidden)
    qkv = linear(0, 0, h)
    q = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim).contiguous()
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    k = k.reshape(rows, kv_heads, head_dim).contiguous()
    v = k.clone()
    attn = torch.empty(rows, heads, head_dim)
    gate_up = linear(2, 0, h)
    act = ops.gated_act(gate_up, False)
    seq_ids = torch.arange(sequences)
    residual = torch.randn(rows, hidden)  # add_rms_norm adds into it
    parts = {
        "norms": lambda: [
            ops.add_rms_norm(x, residual, p[i * 18 + j], 1e-5)
            for i in range(layers)
            for j in (0, 1)
        ],
        "qkv": lambda: [linear(0, i, h) for i in range(layers)],
        "rotary": lambda: [ops.rotary_neox_(q, k, positions, stack.cos, stack.sin) for _ in caches],
        "kv write": lambda: [ops.write_kv_cache_(k, v, kc, vc, slots) for kc, vc in caches],
        "attention": lambda: [
            ops.paged_attention_rows_(
                q, kc, vc, attn, seq_ids, cu, seq_lens, tables, stack.scale, 0, 0.0
            )
            for kc, vc in caches
        ],
        "o": lambda: [linear(1, i, attn.view(rows, -1)) for i in range(layers)],
        "gate_up": lambda: [linear(2, i, h) for i in range(layers)],
        "gated act": lambda: [ops.gated_act(gate_up, False) for _ in range(layers)],
        "down": lambda: [linear(3, i, act) for i in range(layers)],
    }
    result = {name: best_of(repeat, fn) * 1e3 for name, fn in parts.items()}
    # The same attention without the software prefetch of the next chunk (attention.cpp):
    # what it gains, with the same bits.
    was = ops.set_attention_prefetch(False)
    try:
        result["attention, no prefetch"] = best_of(repeat, parts["attention"]) * 1e3
    finally:
        ops.set_attention_prefetch(was)

    meta = type("Step", (), {"slot_mapping": slots, "cu_seqlens_q": cu, "seq_lens": seq_lens,
                             "block_tables": tables})  # fmt: skip
    result["whole stack"] = best_of(repeat, lambda: stack(x, positions, caches, meta)) * 1e3
    result["lm head"] = best_of(repeat, lambda: model.compute_logits(h)) * 1e3

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
                reference.paged_attention(q, kc, vc, ref_out, cu, seq_lens, tables, stack.scale)
                for kc, vc in ref_caches
            ],
        )
        * 1e3
    )
    kv_bytes = rows * keys * layers * 2 * kv_heads * head_dim * caches[0][0].element_size()
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
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "cpu_decode_step.json")
    )
    args = parser.parse_args()
    from pagedllm_integrations import LLM

    all_rows = [int(r) for r in args.rows.split(",")]
    blocks = (1 if args.verify else max(all_rows)) * -(-args.keys // BLOCK) + 1
    llm = LLM(None, num_kv_blocks=blocks, max_model_len=args.keys + BLOCK, disable_log_stats=True)
    report = {"keys": args.keys, "threads": torch.get_num_threads(), "verify": args.verify}
    report["rows"] = {}
    for rows in all_rows:
        report["rows"][str(rows)] = measure(llm, rows, args.keys, args.repeat, args.verify)
    what = "rows of one sequence" if args.verify else "sequences"
    print(f"ms per decode step, all layers ({args.keys} keys per sequence; columns: {what})")
    names = list(report["rows"][str(all_rows[0])])
    print(f"{'':>24}" + "".join(f"{f'{r} rows':>12}" for r in all_rows))
    for name in names:
        print(f"{name:>24}" + "".join(f"{report['rows'][str(r)][name]:>12.2f}" for r in all_rows))
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
