"""What every attention layer needs to find its sequences in the flat batch and the paged cache.

Built once per step by the model runner and passed explicitly down the model (no globals).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = padding)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: q rows of sequence i are cu[i] : cu[i + 1]
    seq_lens: torch.Tensor  # [B] int32: cached tokens of sequence i after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32: block ids of sequence i
    max_seqlen_q: int
    max_seqlen_k: int
    backend: str = "auto"  # kernels.ops backend: auto | torch | triton

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
