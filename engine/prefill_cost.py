"""What a prefill chunk costs at its depth in the prompt, so that a step with decoding
streams in it stays short.

A chunk of `n` prompt tokens that starts at position `d` runs the linears once per token,
and its i-th token's attention reads the `d + i` keys before it (up to a layer's sliding
window). Deep in a long prompt the attention is most of the step: one 4,096-token prompt
of the default model (SmolLM2-135M) in 512-token chunks took 0.40-0.45 s for its first
step and 1.6-2.0 s for its last on a 2-core Xeon (`benchmarks/prefill_chunks.py`), and a
stream decoding beside it waits that whole step for its next token. Prefill speed hardly
depends on the chunk size there (128-token chunks: the same tok/s), so a chunk can be cut
to what the step's budget buys at its depth without slowing the prompt.

The unit of cost is one token's linears ("a token unit"); the step budget,
`max_num_batched_tokens`, is the number of units a step may take. A chunk costs

    units(n, d) = n * (1 + attention(d + n/2) / linears)

where `attention(k)` is the FLOPs of one token's attention over `k` keys, summed over the
layers (each layer's keys capped at its window), times how much slower attention runs
than the linears per FLOP on the device (`ATTENTION_SLOWDOWN`), and `linears` is the
FLOPs of one token's projections and MLP (the routed experts only, for a mixture). The
mean depth `d + n/2` is exact for full attention (it is linear in the depth).
"""

from __future__ import annotations

from dataclasses import dataclass

from .models.config import ModelConfig

# How many times slower, per FLOP, prefill attention runs than the linears. CPU: the last
# 512-token chunk of a 4,096-token prompt ran its attention at ~90 GFLOP/s against the
# linears' ~300 on a Xeon with AMX, and the step times by depth fit 3.2-4.0
# (benchmarks/prefill_chunks.py, two runs); 4 errs toward shorter steps. GPU: not
# measured; flash-style kernels run attention near the matmuls' rate.
ATTENTION_SLOWDOWN = {"cpu": 4.0, "cuda": 1.0}

# The fewest prompt tokens a capped chunk takes, so a prompt always moves (a 16-token
# chunk at 32k depth of the default model costs about one 512-unit budget).
MIN_CHUNK_TOKENS = 16


@dataclass(frozen=True)
class PrefillCost:
    """The cost model of one model on one device (see the module's docstring)."""

    # (attention units per key, window or None) per distinct window, the layers of one
    # window summed; a unit is one token's linears, the device's slowdown folded in.
    units_per_key_by_window: tuple[tuple[float, int | None], ...]

    @classmethod
    def for_model(cls, config: ModelConfig, device_type: str) -> PrefillCost:
        slowdown = ATTENTION_SLOWDOWN.get(device_type, 1.0)
        linears = sum(_linear_flops(config, layer) for layer in range(config.num_layers))
        # QK^T and PV: 2 FLOPs per multiply-add, head_dim each, for every query head.
        per_layer = 4.0 * config.num_heads * config.head_dim * slowdown / linears
        by_window: dict[int | None, float] = {}
        for layer in range(config.num_layers):
            window = config.layer_sliding_window(layer)
            by_window[window] = by_window.get(window, 0.0) + per_layer
        return cls(tuple((per_key, window) for window, per_key in by_window.items()))

    def units(self, num_tokens: int, depth: int) -> float:
        """Token units of a chunk of `num_tokens` prompt tokens that starts at `depth`."""
        mean_keys = depth + num_tokens / 2
        attention = sum(
            per_key * (mean_keys if window is None else min(mean_keys, window))
            for per_key, window in self.units_per_key_by_window
        )
        return num_tokens * (1.0 + attention)

    def tokens_within(self, units_left: float, depth: int, wanted: int, at_least: int) -> int:
        """The longest chunk from `depth`, at most `wanted` tokens, whose units fit in
        `units_left`; at least min(at_least, wanted) tokens even when those do not fit."""
        if self.units(wanted, depth) <= units_left:
            return wanted
        low, high = 0, wanted  # units(low) fits, units(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if self.units(middle, depth) <= units_left:
                low = middle
            else:
                high = middle
        return max(low, min(at_least, wanted))


class StepUnits:
    """One step's budget in token units while streams decode in it (`decoding`): each
    prefill chunk is cut to what is left at its depth, and the first one of the step takes
    at least MIN_CHUNK_TOKENS so a prompt always moves. Without decoding streams (or
    without a cost model) chunks take tokens as the token budget allows, as before: there
    is no inter-token latency to protect, and full chunks keep the linears' rows high."""

    def __init__(self, cost: PrefillCost | None, budget: int, decoding: bool) -> None:
        self.cost = cost if decoding else None
        self.left = float(budget)
        self.first_chunk = True

    def cap(self, wanted: int, depth: int, reserved: int = 0) -> int:
        """Prompt tokens a chunk from `depth` may take (at most `wanted`), leaving
        `reserved` units to the requests behind it."""
        if self.cost is None:
            return wanted
        at_least = MIN_CHUNK_TOKENS if self.first_chunk else 0
        return self.cost.tokens_within(self.left - reserved, depth, wanted, at_least)

    def charge(self, num_tokens: int, depth: int, prefill: bool) -> None:
        if prefill:
            self.first_chunk = False
        if prefill and self.cost is not None:
            self.left -= self.cost.units(num_tokens, depth)
        else:
            self.left -= num_tokens


def _linear_flops(config: ModelConfig, layer: int) -> float:
    """FLOPs of one token through layer `layer`'s projections and MLP."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    sparse = config.num_experts > 0 and (
        config.sparse_layers is None or config.sparse_layers[layer]
    )
    if sparse:
        mlp = 3 * hidden * config.moe_intermediate_size * config.num_experts_per_tok
    else:
        mlp = 3 * hidden * config.intermediate_size
    return 2.0 * (attention + mlp)
