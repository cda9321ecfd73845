"""GPU check and timing of the Triton attention kernels (one GPU, a few minutes).

1. Correctness at full size: the Triton kernels against `kernels/reference.py` run in
   float64 on the same inputs (mixed prefill/decode batches, decode-only with and without
   the split-KV path, sliding window, several head layouts, dtypes and block sizes).
2. Decode attention: achieved GB/s of KV read, against the device's copy bandwidth
   measured here from a large tensor copy, and against torch scaled_dot_product_attention
   on the gathered (contiguous) cache.
3. Prefill attention: TFLOP/s against scaled_dot_product_attention on the gathered cache.
4. reshape_and_cache: GB/s moved.

Prints a table and writes JSON to benchmarks/results/kernels_gpu.json. Exits with a
message (status 0) when there is no CUDA device. `--smoke` runs the same logic at toy
sizes on CPU through Triton's interpreter (wall-clock timing; the numbers mean nothing):
it checks the script itself.

    python benchmarks/kernels_gpu.py [--smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

RESULTS = Path(__file__).resolve().parent / "results" / "kernels_gpu.json"
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@dataclass(slots=True)
class Check:
    name: str
    cases: list[tuple[int, int]]  # (query_len, context_len) per sequence
    heads: tuple[int, int, int] = (32, 8, 128)  # Hq, Hkv, D (Llama-3-8B)
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16
    window: int | None = None
    num_kv_splits: int | None = None


@dataclass(slots=True)
class Sizes:
    copy_bytes: int
    checks: list[Check]
    decode: list[tuple[int, int]]  # (num_seqs, seq_len)
    prefill: list[tuple[int, int, int]]  # (num_seqs, query_len, context_len)
    reshape_tokens: int
    heads: tuple[int, int, int] = (32, 8, 128)
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16


FULL = Sizes(
    copy_bytes=4 << 30,
    checks=[
        Check("mixed (issue)", [(1, 1328), (5, 18), (129, 463)]),
        Check("mixed (issue) fp16", [(1, 1328), (5, 18), (129, 463)], dtype=torch.float16),
        Check("mixed (issue) fp32", [(1, 1328), (5, 18), (129, 463)], dtype=torch.float32),
        Check("mixed large", [(1, 4000)] * 16 + [(512, 1536), (2048, 0), (77, 3000)]),
        Check("decode auto", [(1, 16384)] * 4),
        Check("decode unified", [(1, 16384)] * 4, num_kv_splits=1),
        Check("decode many", [(1, 523), (1, 37), (1, 2011)] * 40),
        Check("window 4096", [(1, 16383), (300, 9000), (1, 5000)], window=4096),
        Check("window decode split", [(1, 16383)] * 2, window=4096, num_kv_splits=8),
        Check("Qwen2 14:2 d64", [(1, 3000), (700, 1300)], heads=(14, 2, 64)),
        Check("MHA d80", [(1, 2000), (256, 512)], heads=(32, 32, 80)),
        Check("GQA 3:1 d96", [(1, 2000), (256, 512)], heads=(12, 4, 96)),
        Check("GQA 2:1 d256", [(1, 2000), (256, 512)], heads=(16, 8, 256)),
        Check("MQA 5:1 d128 bs32", [(1, 2000), (256, 512)], heads=(5, 1, 128), block_size=32),
    ],
    decode=[(1, 32768), (4, 16384), (16, 8192), (64, 4096), (256, 1024)],
    prefill=[(1, 4096, 0), (1, 16384, 0), (8, 1024, 0), (1, 2048, 6144)],
    reshape_tokens=16384,
)

SMOKE = Sizes(
    copy_bytes=1 << 20,
    checks=[
        Check("mixed", [(1, 70), (5, 18), (20, 13)], heads=(4, 2, 64)),
        Check("decode split", [(1, 300)] * 2, heads=(4, 2, 64), num_kv_splits=4),
        Check("window", [(1, 90), (9, 30)], heads=(6, 2, 80), window=24, dtype=torch.float32),
    ],
    decode=[(1, 600)],
    prefill=[(1, 64, 0), (1, 32, 32)],
    reshape_tokens=64,
    heads=(4, 2, 64),
)


@dataclass(slots=True)
class Results:
    device: str
    copy_gbps: float = 0.0
    checks: list[dict] = field(default_factory=list)
    decode: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    reshape_and_cache: list[dict] = field(default_factory=list)


@dataclass(slots=True)
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_seqlen_q: int
    max_seqlen_k: int


def make_batch(cases, heads, block_size, dtype, device) -> Batch:
    """Random batch; block tables from a permutation of all blocks (scattered in memory).
    Keys Gaussian, values in [-1, 1) so bfloat16 output rounding stays well inside 1e-2."""
    num_q_heads, num_kv_heads, head_dim = heads
    seq_lens = [q + c for q, c in cases]
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(cases), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device).to(dtype)
    v_cache = (torch.rand(shape, device=device) * 2 - 1).to(dtype)
    query_lens = torch.tensor([q for q, _ in cases], dtype=torch.int32)
    cu = torch.zeros(len(cases) + 1, dtype=torch.int32)
    cu[1:] = query_lens.cumsum(0)
    q = torch.randn(int(cu[-1]), num_q_heads, head_dim, device=device).to(dtype)
    return Batch(
        q,
        k_cache,
        v_cache,
        cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        tables,
        int(query_lens.max()),
        max(seq_lens),
    )


def run_triton(b: Batch, window: int | None = None, num_kv_splits: int | None = None):
    from pagedllm_integrations.kernels.paged_attention_triton import paged_attention_triton

    out = torch.empty_like(b.q)

    def call() -> torch.Tensor:
        return paged_attention_triton(
            b.q, b.k_cache, b.v_cache, out, b.cu_seqlens_q, b.seq_lens, b.block_tables,
            b.q.shape[-1] ** -0.5, sliding_window=window, max_seqlen_q=b.max_seqlen_q,
            max_seqlen_k=b.max_seqlen_k, num_kv_splits=num_kv_splits,
        )  # fmt: skip

    return call


def check(c: Check, device: str) -> dict:
    from pagedllm_integrations.kernels import reference

    b = make_batch(c.cases, c.heads, c.block_size, c.dtype, device)
    out = run_triton(b, c.window, c.num_kv_splits)().clone()
    want = torch.empty(b.q.shape, dtype=torch.float64, device=device)
    reference.paged_attention(
        b.q.double(), b.k_cache.double(), b.v_cache.double(), want, b.cu_seqlens_q,
        b.seq_lens, b.block_tables, b.q.shape[-1] ** -0.5, c.window,
    )  # fmt: skip
    err = (out.double() - want).abs().max().item()
    ok = err < TOLERANCE[c.dtype] and not out.isnan().any().item()
    return {"name": c.name, "dtype": str(c.dtype).removeprefix("torch."), "heads": c.heads,
            "block_size": c.block_size, "tokens": b.q.shape[0], "max_abs_err": err, "ok": ok}  # fmt: skip


def gathered(b: Batch, cache: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, Hkv, seq_len, D] contiguous: the cache as a dense attention call would want it."""
    from pagedllm_integrations.kernels import reference

    num_blocks = -(-seq_len // cache.shape[1])
    dense = reference.gather_kv(cache, b.block_tables[:, :num_blocks])[:, :seq_len]
    return dense.transpose(1, 2).contiguous()


def dense_baseline(q, k, v, mask=None, causal=False) -> tuple[Callable, str]:
    """torch SDPA on contiguous q [B, Hq, Lq, D], k/v [B, Hkv, L, D], kept off the slow math
    backend where a fused one accepts the call: GQA natively if it can, else K/V expanded to
    Hq heads (more bytes read, still a fused kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    def run(k_, v_, label: str, **kw) -> tuple[Callable, str] | None:
        def call() -> torch.Tensor:
            with sdpa_kernel(fused):
                return sdpa(q, k_, v_, attn_mask=mask, is_causal=causal, **kw)

        try:
            call()
        except RuntimeError:  # no fused backend takes this call
            return None
        return call, label

    group = q.shape[1] // k.shape[1]
    found = run(k, v, "sdpa gqa", enable_gqa=True)
    if found is None:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        found = run(k, v, "sdpa kv expanded")
    if found is None:
        found = partial(sdpa, q, k, v, attn_mask=mask, is_causal=causal), "sdpa math"
    return found


def bench_decode(sizes: Sizes, device: str, timer: Callable, copy_gbps: float) -> list[dict]:
    from pagedllm_integrations.kernels.paged_attention_triton import choose_num_splits

    rows = []
    for num_seqs, seq_len in sizes.decode:
        b = make_batch([(1, seq_len - 1)] * num_seqs, sizes.heads, sizes.block_size,
                       sizes.dtype, device)  # fmt: skip
        num_kv_heads, head_dim = sizes.heads[1], sizes.heads[2]
        splits = choose_num_splits(num_seqs, num_kv_heads, seq_len, torch.device(device))
        kv_bytes = 2 * num_seqs * seq_len * num_kv_heads * head_dim * b.q.element_size()
        t_auto = timer(run_triton(b))
        t_unified = timer(run_triton(b, num_kv_splits=1)) if splits > 1 else t_auto
        k, v = gathered(b, b.k_cache, seq_len), gathered(b, b.v_cache, seq_len)
        q = b.q.view(num_seqs, 1, sizes.heads[0], head_dim).transpose(1, 2)
        baseline, label = dense_baseline(q, k, v)
        t_sdpa = timer(baseline)
        gbps = kv_bytes / t_auto / 1e9
        rows.append({"num_seqs": num_seqs, "seq_len": seq_len, "splits": splits,
                     "triton_ms": t_auto * 1e3, "triton_gbps": gbps,
                     "unified_ms": t_unified * 1e3, "sdpa_ms": t_sdpa * 1e3,
                     "sdpa_gbps": kv_bytes / t_sdpa / 1e9, "baseline": label,
                     "fraction_of_copy_bw": gbps / copy_gbps if copy_gbps else 0.0,
                     "speedup_vs_sdpa": t_sdpa / t_auto})  # fmt: skip
        del b, k, v
    return rows


def bench_prefill(sizes: Sizes, device: str, timer: Callable) -> list[dict]:
    rows = []
    num_q_heads, _, head_dim = sizes.heads
    for num_seqs, query_len, context_len in sizes.prefill:
        b = make_batch([(query_len, context_len)] * num_seqs, sizes.heads, sizes.block_size,
                       sizes.dtype, device)  # fmt: skip
        seq_len = query_len + context_len
        # Each query j sees context_len + j + 1 keys: 4 * D flops per (query, key, head).
        pairs = query_len * context_len + query_len * (query_len + 1) // 2
        flops = 4 * head_dim * num_q_heads * num_seqs * pairs
        t_triton = timer(run_triton(b))
        k, v = gathered(b, b.k_cache, seq_len), gathered(b, b.v_cache, seq_len)
        q = b.q.view(num_seqs, query_len, num_q_heads, head_dim).transpose(1, 2)
        if context_len == 0:  # torch's is_causal is top-left aligned: right only without context
            mask, causal = None, True
        else:
            key_pos = torch.arange(seq_len, device=device)
            mask = key_pos[None, :] <= (key_pos[context_len:, None])
            causal = False
        baseline, label = dense_baseline(q, k, v, mask, causal)
        t_sdpa = timer(baseline)
        rows.append({"num_seqs": num_seqs, "query_len": query_len, "context_len": context_len,
                     "triton_ms": t_triton * 1e3, "triton_tflops": flops / t_triton / 1e12,
                     "sdpa_ms": t_sdpa * 1e3, "sdpa_tflops": flops / t_sdpa / 1e12,
                     "speedup_vs_sdpa": t_sdpa / t_triton, "baseline": label})  # fmt: skip
        del b, k, v
    return rows


def bench_reshape_and_cache(sizes: Sizes, device: str, timer: Callable) -> list[dict]:
    from pagedllm_integrations.kernels import reference
    from pagedllm_integrations.kernels.reshape_and_cache_triton import reshape_and_cache_triton

    _, num_kv_heads, head_dim = sizes.heads
    tokens, bs = sizes.reshape_tokens, sizes.block_size
    num_blocks = 2 * tokens // bs
    shape = (num_blocks, bs, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=sizes.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(tokens, num_kv_heads, head_dim, device=device).to(sizes.dtype)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * bs, device=device)[:tokens]
    slots[::7] = -1
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.reshape_and_cache(k, v, want_k, want_v, slots)
    ok = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    t = timer(lambda: reshape_and_cache_triton(k, v, k_cache, v_cache, slots))
    moved = 2 * 2 * k.numel() * k.element_size()  # read k, v and write them
    return [{"tokens": tokens, "ok": ok, "ms": t * 1e3, "gbps": moved / t / 1e9}]


def cuda_timer(fn: Callable) -> float:
    """Seconds per call, replayed from a CUDA graph so that Python launch overhead (which the
    engine's decode graphs also remove) does not hide the kernel time of short calls."""
    import triton.testing

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") / 1e3
    except RuntimeError:  # not capturable: events around eager calls
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def wall_timer(fn: Callable) -> float:
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int, device: str, timer: Callable) -> float:
    """GB/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timer(lambda: dst.copy_(src)) / 1e9


def print_table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    print(f"\n## {title}")
    cols = list(rows[0])
    cells = [[f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(row, widths)) + " |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes on CPU (interpreter)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON output path")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        device, sizes, timer = "cpu", SMOKE, wall_timer
        name = "cpu (Triton interpreter, smoke run)"
    elif not torch.cuda.is_available():
        print("kernels_gpu: no CUDA device here; nothing to measure (use --smoke to check the "
              "script on CPU).")  # fmt: skip
        return 0
    else:
        device, sizes, timer = "cuda", FULL, cuda_timer
        name = torch.cuda.get_device_name()
    torch.manual_seed(0)
    res = Results(device=name)
    res.copy_gbps = copy_bandwidth(sizes.copy_bytes, device, timer)
    res.checks = [check(c, device) for c in sizes.checks]
    res.decode = bench_decode(sizes, device, timer, res.copy_gbps)
    res.prefill = bench_prefill(sizes, device, timer)
    res.reshape_and_cache = bench_reshape_and_cache(sizes, device, timer)

    print(f"# Triton attention kernels on {name}; heads {sizes.heads}, {sizes.dtype}")
    print(f"device copy bandwidth: {res.copy_gbps:.0f} GB/s (read + write)")
    print_table("correctness vs float64 torch reference", res.checks)
    print_table("decode (KV read GB/s)", res.decode)
    print_table("prefill (TFLOP/s)", res.prefill)
    print_table("reshape_and_cache", res.reshape_and_cache)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(res)
    data["shape"] = {
        "heads": sizes.heads,
        "dtype": str(sizes.dtype),
        "block_size": sizes.block_size,
    }
    args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"\nwrote {args.out}")
    failed = [c["name"] for c in res.checks if not c["ok"]]
    failed += ["reshape_and_cache"] * (not all(r["ok"] for r in res.reshape_and_cache))
    if failed:
        print(f"FAILED correctness: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
