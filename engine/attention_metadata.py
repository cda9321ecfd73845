"""What every attention layer needs to find its sequences in the flat batch and the paged cache.

Built once per step by the model runner and passed explicitly down the model (no globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
    # A layout with several block-table groups (engine/kv_layout.py): every group's
    # tables [G, B, max_blocks] and slot mappings [G, T] (slot_mapping and block_tables
    # above are group 0's), each layer's group, and the metadata of groups 1 .. G-1.
    group_block_tables: torch.Tensor | None = None
    group_slot_mappings: torch.Tensor | None = None
    layer_groups: tuple[int, ...] = ()
    _other_groups: list[AttentionMetadata] = field(default_factory=list, repr=False)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def set_groups(
        self, tables: torch.Tensor, slot_mappings: torch.Tensor, layer_groups: tuple[int, ...]
    ) -> None:
        """Attach every group's tables [G, B, max_blocks] and slot mappings [G, T].

        One metadata object per group, made here once a step: the kernels' host-side plans
        are keyed by these tensors' identities (kernels/reference.py), so each layer of a
        group must see the same objects."""
        self.group_block_tables, self.group_slot_mappings = tables, slot_mappings
        self.layer_groups = tuple(layer_groups)
        # Not self among them: no reference cycle, so a step's tensors go when it ends.
        self._other_groups = [
            replace(self, block_tables=tables[g], slot_mapping=slot_mappings[g], _other_groups=[])
            for g in range(1, int(tables.shape[0]))
        ]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with: its group's tables and slots."""
        group = self.layer_groups[layer] if self.layer_groups else 0
        return self._other_groups[group - 1] if group else self
