"""A quantized GGUF weight as the loader hands it on: still in llama.cpp's blocks.

engine/gguf_loader.py makes these from the memory-mapped file; the fast path's linears pack
them for the C++ kernels (packed_linear.py), the others dequantize them (`dense`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .gguf_blocks import dequantize_to


@dataclass(slots=True)
class GGUFTensor:
    """One quantized GGUF weight [N, K], still in llama.cpp's blocks.

    data: uint8 [N, bytes per row] (a view of the memory-mapped file, rows possibly
    reordered); type_name: the GGML type (Q4_1, Q4_K, ...).
    """

    type_name: str
    data: np.ndarray
    shape: tuple[int, int]

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight dequantized (as llama.cpp dequantizes it), as a torch tensor."""
        return dequantize_to(self.type_name, self.data, self.shape, dtype)

    def permute_rows(self, order: np.ndarray) -> GGUFTensor:
        return GGUFTensor(self.type_name, self.data[order], self.shape)

    def rows(self, start: int, stop: int) -> GGUFTensor:
        """Rows start..stop-1 (one expert of a stacked tensor, one linear of a fused one)."""
        return GGUFTensor(self.type_name, self.data[start:stop], (stop - start, self.shape[1]))
