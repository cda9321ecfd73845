"""AWQ INT4 GEMM on one GPU: Triton dequant-GEMM against an fp16 matmul of the same shape.

For M (tokens) in 1, 16, 256 and Llama-7B-like shapes (K, N) = (4096, 4096), (4096, 11008),
(11008, 4096), group size 128, it times
  fp16        x @ Wᵀ with W in fp16 (cuBLAS)
  awq         the dispatch AWQLinear uses (fused split-K kernel below 256 tokens,
              Triton dequantize + cuBLAS from 256)
  awq_fused   the fused kernel forced at every M
and checks each AWQ result against the torch reference dequantization. Prints a table and
writes benchmarks/results/awq_gpu.json. Under 5 minutes; exits with a message without CUDA.

    .venv/bin/python benchmarks/awq_gpu.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "awq_gpu.json"
SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096)]
TOKENS = [1, 16, 256]
GROUP = 128


def main() -> int:
    if not torch.cuda.is_available():
        print("awq_gpu.py needs a CUDA GPU; none is visible here (nothing measured).")
        return 0
    from triton.testing import do_bench

    from pagedllm_integrations.quant.awq_format import dequantize, pack_int4
    from pagedllm_integrations.quant.awq_triton import awq_gemm_triton, awq_linear_triton

    device = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for k, n in SHAPES:
        qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen)).to(device)
        qzeros = pack_int4(torch.randint(0, 16, (k // GROUP, n), generator=gen)).to(device)
        scales = (torch.rand(k // GROUP, n, generator=gen) * 0.01 + 1e-3).half().to(device)
        w_t = dequantize(qweight, qzeros, scales, GROUP, torch.float16)  # [K, N] reference
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen).half().to(device)
            expected = (x.float() @ w_t.float()).half()
            got = awq_linear_triton(x, qweight, qzeros, scales, GROUP)
            fused = awq_gemm_triton(x, qweight, qzeros, scales, GROUP)
            scale = float(expected.float().abs().max())
            err = float((got.float() - expected.float()).abs().max()) / scale
            err_fused = float((fused.float() - expected.float()).abs().max()) / scale
            t_fp16 = do_bench(lambda x=x, w_t=w_t: x @ w_t)
            t_awq = do_bench(
                lambda x=x, q=qweight, z=qzeros, s=scales: awq_linear_triton(x, q, z, s, GROUP)
            )
            t_fused = do_bench(
                lambda x=x, q=qweight, z=qzeros, s=scales: awq_gemm_triton(x, q, z, s, GROUP)
            )
            rows.append(
                {
                    "m": m,
                    "k": k,
                    "n": n,
                    "fp16_ms": t_fp16,
                    "awq_ms": t_awq,
                    "awq_fused_ms": t_fused,
                    "speedup_vs_fp16": t_fp16 / t_awq,
                    "rel_err": err,
                    "rel_err_fused": err_fused,
                    "weight_mib_fp16": k * n * 2 / 2**20,
                    "weight_mib_awq": (
                        qweight.numel() * 4 + qzeros.numel() * 4 + scales.numel() * 2
                    )
                    / 2**20,
                }
            )
    print(f"GPU: {torch.cuda.get_device_name(device)}, group size {GROUP}")
    header = f"{'M':>4} {'K':>6} {'N':>6} {'fp16 ms':>9} {'awq ms':>9} {'fused ms':>9} {'speedup':>8} {'rel err':>9}"
    print(header)
    for r in rows:
        print(
            f"{r['m']:>4} {r['k']:>6} {r['n']:>6} {r['fp16_ms']:>9.4f} {r['awq_ms']:>9.4f} "
            f"{r['awq_fused_ms']:>9.4f} {r['speedup_vs_fp16']:>7.2f}x {r['rel_err']:>9.2e}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps({"device": torch.cuda.get_device_name(device), "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {RESULTS}")
    bad = [r for r in rows if max(r["rel_err"], r["rel_err_fused"]) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
