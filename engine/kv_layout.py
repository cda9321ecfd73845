"""Which KV cache tensors and which block table each attention layer uses.

A model whose layers all see the whole sequence has one group: every layer has its own
key/value tensors and every layer reads the request's one block table. A model with
sliding-window layers (Gemma 2 and 3, Mistral, gpt-oss style) would then keep, in every
sliding layer, keys that no query will read again: at 32k tokens Gemma 3's five local
layers of six hold 32k keys each where 512 are ever read.

By default (engine_builder's `_choose_kv_layout`; `disable_hybrid_kv_cache_manager`, vLLM's
name for the switch, keeps the plain layout) such a model's layers are split into groups,
each with a block table of its own per request:

    group 0           the full-attention layers: one block per B tokens, all kept
    groups 1 .. S     the sliding layers, `slots` of them per group (the last one may have
                      fewer): a block per B tokens too, but a block whose tokens every
                      later query's window has left is freed and reused by anyone

and a block id names `slots` tensors' rows, not `num_layers`: the k-th layer of every
group stores its keys in cache tensor pair k (`layer_slots`). A block allocated to group 0
holds full layers' keys; the same id allocated to group 2 would hold the keys of group
2's layers. Every group draws from one pool, so no memory is set aside per kind of layer:

    Gemma 3 270M: 18 layers, 3 global (5, 11, 17) + 15 sliding (window 512): slots = 3
        tensors: 3 (key, value) pairs instead of 18
        layer:   0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17
        group:   1  1  1  2  2  0  2  3  3  3  4  0  4  4  5  5  5  0
        slot:    0  1  2  0  1  0  2  0  1  2  0  1  1  2  0  1  2  2

    (full layers in order to group 0; sliding layers in order, `slots` to a group)

A sequence of n tokens holds ceil(n / B) blocks in group 0 and at most about
(window + step tokens) / B in each sliding group, so at 32k tokens Gemma 3 270M's cache is
2,048 + 5 x 65 blocks of 3 layers against 2,048 blocks of 18 layers (about 5x less).

Every attention path uses, for a sliding layer, only keys in its window (kernels/
reference.py gathers and masks the others, kernels/csrc/attention.cpp starts at the
window, the Triton kernel loops from the window's tile), so what a freed entry of a
sliding table points at (block 0, whoever holds it now) never reaches an output. The prefix cache keeps one hash chain; a sliding group's block is
registered under the chain hash mixed with its group (`group_hash`), and a prefix is hit
only as far as every sliding group still has the blocks its window needs there
(kv_cache_manager.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xxhash


@dataclass(frozen=True, slots=True)
class KVLayout:
    layer_groups: tuple[int, ...]  # per layer: the block-table group it reads and writes
    layer_slots: tuple[int, ...]  # per layer: the cache tensor pair its keys live in
    group_windows: tuple[int | None, ...]  # per group: its layers' window, None = all kept
    num_slots: int  # cache tensor pairs; a block is one row of each

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def grouped(self) -> bool:
        """More than one block table per request (else the plain one-table layout)."""
        return self.num_groups > 1 or self.group_windows[0] is not None

    def sequence_blocks(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` holds, across groups, when a step
        adds up to `step_tokens` of its tokens."""
        entries = -(-num_tokens // block_size)
        total = 0
        for window in self.group_windows:
            if window is None:
                total += entries
            else:  # from the window's start before the step to the step's last token
                total += min(entries, -(-(window - 1 + step_tokens) // block_size) + 1)
        return total

    def max_sequence_tokens(self, num_blocks: int, block_size: int, step_tokens: int) -> int:
        """The longest sequence `num_blocks` blocks hold (sequence_blocks' inverse), in
        whole blocks; a layout of windowed groups only holds any length in a fixed number."""
        if (
            None not in self.group_windows
            and self.sequence_blocks(1 << 40, block_size, step_tokens) <= num_blocks
        ):
            return 1 << 40
        low, high = 0, num_blocks  # in blocks of tokens
        while low < high:
            mid = (low + high + 1) // 2
            if self.sequence_blocks(mid * block_size, block_size, step_tokens) <= num_blocks:
                low = mid
            else:
                high = mid - 1
        return low * block_size


def plain_layout(num_layers: int) -> KVLayout:
    """One group, a tensor pair per layer: every layer keeps the whole sequence."""
    return KVLayout(
        layer_groups=(0,) * num_layers,
        layer_slots=tuple(range(num_layers)),
        group_windows=(None,),
        num_slots=num_layers,
    )


def windowed_layout(layer_windows: Sequence[int | None]) -> KVLayout:
    """Layers grouped so that sliding layers free what left their window (module doc).

    layer_windows: per layer its sliding window, None where it sees the whole sequence.
    """
    num_layers = len(layer_windows)
    full = [i for i, window in enumerate(layer_windows) if not window]
    sliding = [i for i, window in enumerate(layer_windows) if window]
    if not sliding:
        return plain_layout(num_layers)
    # Sliding layers with the same window share groups; a group never mixes windows.
    by_window: dict[int, list[int]] = {}
    for layer in sliding:
        by_window.setdefault(int(layer_windows[layer] or 0), []).append(layer)
    # A group per kind of layer when none attends fully (all-sliding models: one).
    slots = len(full) if full else max(len(layers) for layers in by_window.values())
    groups = [0] * num_layers
    layer_slots = [0] * num_layers
    windows: list[int | None] = [None] if full else []
    for slot, layer in enumerate(full):
        layer_slots[layer] = slot
    for window, layers in by_window.items():
        for start in range(0, len(layers), slots):
            group = len(windows)
            windows.append(window)
            for slot, layer in enumerate(layers[start : start + slots]):
                groups[layer] = group
                layer_slots[layer] = slot
    return KVLayout(tuple(groups), tuple(layer_slots), tuple(windows), slots)


def group_hash(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block of `group` whose tokens chain to `block_hash`
    (group 0 keeps the chain hash itself, so the one-group layout's keys are unchanged)."""
    if group == 0:
        return block_hash
    data = block_hash.to_bytes(8, "little") + group.to_bytes(4, "little")
    return xxhash.xxh3_64_intdigest(data)


def first_kept_entry(window: int | None, first_new_position: int, block_size: int) -> int:
    """The first block-table entry a group still needs when the step's first new token
    is at `first_new_position`: its window reaches back to position - window + 1."""
    if window is None:
        return 0
    return max(0, (first_new_position - window + 1) // block_size)


def describe_layout(layout: KVLayout) -> str:
    """For the startup log line: nothing for the plain layout."""
    if not layout.grouped:
        return ""
    windows = sorted({window for window in layout.group_windows if window is not None})
    sliding = sum(1 for group in layout.layer_groups if layout.group_windows[group] is not None)
    keep = f"{sliding} sliding-window layers keep their last {', '.join(map(str, windows))} tokens"
    if layout.num_groups == 1:  # every layer slides (Mistral, Phi-3): one windowed table
        return f" ({keep})"
    return (
        f", each block {layout.num_slots} layers' keys and values ({keep}, in block tables "
        f"of their own: {layout.num_groups} tables per request)"
    )
