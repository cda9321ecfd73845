"""Self-attention over the paged KV cache, shared by every family.

x [T, hidden] -> qkv_proj (one stacked matmul) -> q [T, Hq, D], k, v [T, Hkv, D]
  -> q_norm / k_norm over D (Qwen3, Gemma 3)          optional
  -> rotary (full or partial; per layer: Gemma 3's sliding layers have their own base)
  -> reshape_and_cache into this layer's blocks
  -> paged_attention (scale, sliding window and logit soft-cap of this layer)
  -> o_proj -> [T, hidden]

A bidirectional model (EmbeddingGemma: `ModelConfig.causal` False) keeps no KV cache: each
sequence of the step (run whole, engine/scheduler.py) attends to all of its own tokens, or,
in a sliding layer, to those within the window on either side.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import ops
from ..attention_metadata import AttentionMetadata
from .config import ModelConfig
from .layers import LinearFactory, RMSNorm
from .rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        prefix: str,
        make_linear: LinearFactory,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
        fused: bool = False,
    ):
        """fused: the norms on the backend's C++ kernels (backend.fused_kernels)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.layer_sliding_window(layer)
        self.logits_soft_cap = cfg.attn_logit_softcap
        self.causal = cfg.causal
        self.fused = fused
        # Bidirectional sliding layers: transformers' Gemma3TextConfig reads a window W as
        # reaching W // 2 tokens to either side (|i - j| < W // 2 + 1).
        self.reach = None
        if not cfg.causal and self.sliding_window is not None:
            self.reach = self.sliding_window // 2
        self.qkv_proj = make_linear(
            cfg.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            cfg.qkv_bias,
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"],
            dtype,
            device,
        )
        self.o_proj = make_linear(
            self.q_size, [cfg.hidden_size], cfg.o_bias, [f"{prefix}.o_proj"], dtype, device
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            offset = cfg.rms_norm_unit_offset
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, offset, fused)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, offset, fused)
        self.rotary = rotary

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if not self.causal:  # nothing cached: each sequence sees all of itself
            out = self._bidirectional(q, k, v, meta.cu_seqlens_q.tolist())
            return self.o_proj(out.view(num_tokens, self.q_size))
        k_cache, v_cache = kv_cache
        ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        out = torch.empty_like(q)
        ops.paged_attention(
            q,
            k_cache,
            v_cache,
            out,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            self.scale,
            sliding_window=self.sliding_window,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            backend=meta.backend,
            k_new=k,
            v_new=v,
            logits_soft_cap=self.logits_soft_cap,
        )
        return self.o_proj(out.view(num_tokens, self.q_size))

    def _bidirectional(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]
    ) -> torch.Tensor:
        """q [T, Hq, D], k and v [T, Hkv, D]; sequence i is rows bounds[i]:bounds[i + 1]
        -> [T, Hq, D]. Scores in float32 (soft-capped where the model is).

        On the fast path a sequence that needs no mask (a full layer, or one no longer than
        a sliding layer's reach) runs the C++ encoder attention (kernels/csrc/encoder.cpp),
        the others torch: chosen per sequence, so that a text's bits do not depend on what
        it is batched with."""
        group = self.num_heads // self.num_kv_heads
        pairs = list(itertools.pairwise(bounds))
        fits = [self._unmasked_kernel(end - start, q) for start, end in pairs]
        if all(fits):  # one call for the step (the same bits as one call a sequence)
            return self._kernel_attention(q, k, v, bounds, group)
        out = torch.empty_like(q)
        for (start, end), fit in zip(pairs, fits, strict=True):
            rows = slice(start, end)
            if fit:
                out[rows] = self._kernel_attention(
                    q[rows], k[rows], v[rows], [0, end - start], group
                )
            else:
                out[rows] = self._torch_attention(q[rows], k[rows], v[rows], group)
        return out

    def _unmasked_kernel(self, length: int, q: torch.Tensor) -> bool:
        """Whether a sequence of `length` runs the C++ encoder attention."""
        unmasked = self.reach is None or length <= self.reach + 1
        return self.fused and unmasked and not self.logits_soft_cap and q.dtype == torch.float32

    def _kernel_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], group: int
    ) -> torch.Tensor:
        """The C++ op takes [T, 3, H, D]: k and v repeated up to q's heads."""
        qkv = torch.stack(
            (q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)), dim=1
        )
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
        return torch.ops.pagedllm.encoder_attention(qkv, cu_seqlens, self.scale)

    def _torch_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int
    ) -> torch.Tensor:
        """One sequence: q [L, Hq, D], k and v [L, Hkv, D] -> [L, Hq, D]."""
        length = q.shape[0]
        qs = q.transpose(0, 1).float()  # [Hq, L, D]
        ks = k.transpose(0, 1).float().repeat_interleave(group, dim=0)
        vs = v.transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = torch.bmm(qs * self.scale, ks.transpose(1, 2))  # [Hq, L, L]
        if self.logits_soft_cap:
            scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if self.reach is not None and length > self.reach + 1:
            index = torch.arange(length, device=q.device)
            far = (index[:, None] - index[None, :]).abs() > self.reach
            scores = scores.masked_fill(far, float("-inf"))
        attended = torch.bmm(F.softmax(scores, dim=-1), vs)  # [Hq, L, D]
        return attended.transpose(0, 1).to(q.dtype)
