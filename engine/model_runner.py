"""Turns a scheduler step into one flat forward pass over the paged KV cache.

For scheduled requests r0 (3 new tokens from position 16), r1 (decode at position 7) and
r2 (1 new token at position 0), with block_size 16:

    input_ids     [t16 t17 t18 | t7 | t0]              T = 5
    positions     [16  17  18  | 7  | 0 ]
    cu_seqlens_q  [0, 3, 4, 5]
    seq_lens      [19, 8, 1]
    slot_mapping  [b0[1]*16+0, b0[1]*16+1, b0[1]*16+2, b1[0]*16+7, b2[0]*16+0]
    block_tables  [[b0[0], b0[1]], [b1[0], pad], [b2[0], pad]]

Only the last token of a sequence whose known tokens are now all computed gets logits,
and, for a sequence verifying k draft tokens (speculative decoding), the k positions before
it too: its last known token and its drafts run as k + 1 query rows, and each gets logits

    r1 verifying drafts d1 d2:   input_ids [... | t7 d1 d2 | ...]   logits rows: t7 d1 d2
    (the target's next token after t7, after d1 and after d2: 3 rows for r1)
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
from collections.abc import Sequence

import numpy as np
import torch

from .attention_metadata import AttentionMetadata
from .kv_disk_tier import NO_KV_DISK, KVDiskFile, KVDiskPlan
from .kv_layout import KVLayout, plain_layout
from .models.causal_lm import CausalLM
from .pooling import PooledParts, pool_step
from .scheduler import SchedulerOutput
from .swap_space import NO_SWAP, SwapPlan, SwapSpace

logger = logging.getLogger(__name__)


def profile_kv_blocks(
    model: CausalLM,
    device: torch.device,
    tokens: int,
    block_size: int,
    backend: str,
    per_block: int,
    gpu_memory_utilization: float,
    num_logit_rows: int = 1,
) -> int:
    """KV blocks that fit on this GPU after a warm-up forward of `tokens` tokens.

    Under tensor parallelism every rank runs it together (the forward all-reduces) and
    the caller takes the minimum over ranks.
    """
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    warmup_blocks = -(-tokens // block_size)
    runner = ModelRunner(model, warmup_blocks, block_size, device, attention_backend=backend)
    positions = torch.arange(tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(warmup_blocks, dtype=torch.int32, device=device)[None],
        max_seqlen_q=tokens,
        max_seqlen_k=tokens,
        backend=backend,
    )
    with torch.inference_mode():
        ids = torch.zeros(tokens, dtype=torch.long, device=device)
        runner.forward(ids, positions, meta, positions[-num_logit_rows:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    return max(int((total * gpu_memory_utilization - peak) // per_block), 0)


def kv_cache_shapes(
    attention_backend: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's key and value caches.

    torch / Triton:  k, v [num_blocks, block_size, Hkv, D]
    cpu (the fast path's C++ kernels): k [num_blocks, Hkv, D, block_size] (keys transposed),
                                       v [num_blocks, Hkv, block_size, D]
    """
    if attention_backend == "cpu":
        return (
            (num_blocks, num_kv_heads, head_dim, block_size),
            (num_blocks, num_kv_heads, block_size, head_dim),
        )
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return shape, shape


def _zeros_on_huge_pages(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """torch.zeros(shape), in fresh anonymous pages asked to be backed by 2 MiB pages.

    Decode attention reads a few KiB from every block of every sequence, one 4 KiB page
    after another; on 2 MiB pages it misses the TLB far less (decode attention over 64
    sequences x 192 keys, 30 layers: 16.7 -> 15.8 ms per step on a 2-core Zen 5).
    Linux's transparent huge pages in `madvise` mode (a common default) back such a range
    on first touch, so the advice comes before any write. The pages come zeroed from the
    kernel when first touched, so nothing is written here: a KV cache of a GiB costs no
    time at load (zeroing it took seconds of the first call on a busy 2-core machine), and
    only the blocks requests use become resident. Where the advice cannot be given (no THP,
    not Linux) the tensor is the same zeros on small pages."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError, AttributeError, ValueError):
        pages.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps the mapping alive as long as the tensor; it is unmapped with it.
    return torch.frombuffer(pages, dtype=dtype, count=numel).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        attention_backend: str = "auto",
        swap: SwapPlan = NO_SWAP,
        kv_cache_dtype: torch.dtype | None = None,
        kv_disk: KVDiskPlan = NO_KV_DISK,
        layout: KVLayout | None = None,
    ):
        """num_blocks: every KV block, the last kv_disk.blocks of them in the disk tier.
        layout: which cache tensors and block table each layer uses (engine/kv_layout.py;
        default: a tensor pair per layer, one table)."""
        cfg = model.config
        self.layout = layout = layout or plain_layout(cfg.num_layers)
        assert len(layout.layer_slots) == cfg.num_layers, (layout, cfg.num_layers)
        kv_dtype = kv_cache_dtype or model.dtype
        self.model = model
        self.block_size = block_size
        self.device = device
        self.backend = attention_backend
        k_shape, v_shape = kv_cache_shapes(
            attention_backend, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim
        )
        # One (key, value) pair of tensors per slot of the layout (per layer in the plain
        # one); blocks along dim 0 in every layout.
        disk_file = None
        if kv_disk.blocks:
            disk_file = KVDiskFile(kv_disk, [k_shape, v_shape] * layout.num_slots, kv_dtype)

        def zeros(shape: tuple[int, ...]) -> torch.Tensor:
            if disk_file is not None:
                return disk_file.zeros(shape)
            return _zeros_on_huge_pages(shape, kv_dtype, device)

        try:
            # Every distinct tensor pair once: what block copies (swap, the disk tier's
            # moves, the disk prefix cache) go over.
            self.kv_slots = [(zeros(k_shape), zeros(v_shape)) for _ in range(layout.num_slots)]
        finally:
            if disk_file is not None:
                disk_file.close()  # the mappings hold the file; an early failure frees it
        # Per layer, the pair it reads and writes (the same pair for the k-th layer of
        # every group of a grouped layout).
        self.kv_caches = [self.kv_slots[slot] for slot in layout.layer_slots]
        # Blocks from here on are in the disk tier; steps count how many they read.
        self.first_disk_block = num_blocks - kv_disk.blocks
        self.num_blocks = num_blocks
        self.kv_disk_block_reads = 0
        self.swap_space = SwapSpace(
            swap, k_shape, v_shape, layout.num_slots, kv_dtype, pin_memory=device.type == "cuda"
        )

    # ------------------------------------------------------------------ inputs
    def prepare(
        self, out: SchedulerOutput, block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Flat inputs for a step. block_tables[i][g] is block-table group g of
        out.scheduled[i] (one group in the plain layout; KVCacheManager.get_block_tables).

        Returns input_ids [T], positions [T], metadata, logits_indices [N] and the indexes
        (into out.scheduled) of the requests that get a sampled token: each has one logits
        row, or 1 + k consecutive rows when it verifies k draft tokens.
        """
        bs = self.block_size
        scheduled = out.scheduled
        num_tokens = out.num_batched_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        cu_seqlens = np.zeros(len(scheduled) + 1, dtype=np.int32)
        seq_lens = np.empty(len(scheduled), dtype=np.int32)
        num_groups = self.layout.num_groups
        max_blocks = max((len(tables[0]) for tables in block_tables), default=0)
        # [groups, B, max_blocks] and [groups, T]: group 0 first (the only one, plain).
        group_tables = np.zeros((num_groups, len(scheduled), max_blocks), dtype=np.int32)
        group_slots = np.empty((num_groups, num_tokens), dtype=np.int64)
        sampled_rows: list[int] = []
        logit_rows: list[int] = []
        offset = 0
        for i, (item, tables) in enumerate(zip(scheduled, block_tables)):
            start, n = item.start, item.num_tokens
            end = offset + n
            num_drafts = len(item.draft_token_ids)
            known = n - num_drafts
            input_ids[offset : offset + known] = item.request.all_token_ids[start : start + known]
            if num_drafts:
                input_ids[offset + known : end] = item.draft_token_ids
            pos = np.arange(start, start + n)
            positions[offset:end] = pos
            if tables and tables[0]:  # every group has an entry per block of tokens
                table = np.asarray(tables, dtype=np.int64)  # [groups, entries]
                group_tables[:, i, : table.shape[1]] = table
                group_slots[:, offset:end] = table[:, pos // bs] * bs + pos % bs
            else:  # an encoder's prompt: nothing is cached
                group_slots[:, offset:end] = -1
            seq_lens[i] = start + n
            cu_seqlens[i + 1] = end
            if item.completes_prompt and item.request.pooling is None:
                sampled_rows.append(i)
                logit_rows.extend(range(end - 1 - num_drafts, end))
            offset = end
        if self.first_disk_block < self.num_blocks:
            self.kv_disk_block_reads += int(np.count_nonzero(group_tables >= self.first_disk_block))
        to = self.device
        tables_t = torch.from_numpy(group_tables).to(to)
        slots_t = torch.from_numpy(group_slots).to(to)
        meta = AttentionMetadata(
            slot_mapping=slots_t[0],
            cu_seqlens_q=torch.from_numpy(cu_seqlens).to(to),
            seq_lens=torch.from_numpy(seq_lens).to(to),
            block_tables=tables_t[0],
            max_seqlen_q=max(item.num_tokens for item in scheduled),
            max_seqlen_k=int(seq_lens.max()),
            backend=self.backend,
        )
        if self.layout.grouped:
            meta.set_groups(tables_t, slots_t, self.layout.layer_groups)
        logits_indices = torch.tensor(logit_rows, dtype=torch.long, device=to)
        return (
            torch.from_numpy(input_ids).to(to),
            torch.from_numpy(positions).to(to),
            meta,
            logits_indices,
            sampled_rows,
        )

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: list[list[list[int]]]
    ) -> tuple[torch.Tensor, list[int], PooledParts]:
        """Run one step; returns logits [N, vocab] (float32), the rows they belong to, and
        what the step's rows add to each embedding request (engine/pooling.py)."""
        self.swap(out.swap_out, out.swap_in, out.swap_ahead)
        input_ids, positions, meta, logits_indices, sampled_rows = self.prepare(out, block_tables)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        pooled = pool_step(hidden, out.scheduled) if out.num_pooling else {}
        return self.logits(hidden, logits_indices), sampled_rows, pooled

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,  # [N] rows of the flat batch that sample
    ) -> torch.Tensor:
        """The model over one flat batch: logits [N, vocab] float32 (None: no logits, [0, V])."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.logits(hidden, logits_indices)

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, hidden] -> logits [N, vocab] float32 of the rows that sample."""
        if logits_indices is None or logits_indices.numel() == 0:
            # A step of prompt chunks only samples nothing (and the fast path's linear
            # kernels take at least one row).
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[logits_indices])

    def swap(
        self,
        swap_out: list[tuple[list[int], list[int]]],
        swap_in: list[tuple[list[int], list[int]]],
        swap_ahead: Sequence[int] = (),
    ) -> None:
        """Copy preempted requests' blocks to swap space, and resumed ones back; then
        start reading ahead the disk slots of the requests expected to resume next.

        Each swap entry is (block ids in the KV cache, slots in the swap space's tiers)."""
        for block_ids, slots in swap_out:
            self.swap_space.store(self.kv_slots, block_ids, slots)
        for block_ids, slots in swap_in:
            self.swap_space.load(self.kv_slots, block_ids, slots)
        if swap_ahead:
            self.swap_space.read_ahead(swap_ahead)
