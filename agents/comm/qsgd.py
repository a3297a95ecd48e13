"""QSGD-style stochastic quantization to 8 or 4 bits, with error feedback.

Each chunk of :data:`CHUNK` elements is scaled by its largest magnitude and
rounded stochastically to ``2·s + 1`` levels (``s = 127`` for 8 bits, ``7``
for 4 bits, two codes per byte), so the code is unbiased.  What rounding
loses is kept as a residual and added to the next step's gradient.  The
payload is bytes: codes, then the float32 chunk scales.  Codes cannot be
summed on the wire without overflowing, so payloads are all-gathered and
each rank decodes and sums them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from agents.comm.api import Encoded

#: Elements sharing one scale.
CHUNK = 1024


class QSGDCompressor:
    """Stochastic quantization with a max-magnitude scale per chunk.

    Args:
        bits: 8 or 4.
    """

    payload_dtype = torch.uint8
    buffer_names: tuple[str, ...] = ("residual",)

    def __init__(self, bits: int = 8) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        self.bits = bits
        self.levels = 127 if bits == 8 else 7

    def code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else (numel + 1) // 2

    def payload_bytes(self, numel: int) -> int:
        return self.code_bytes(numel) + 4 * -(-numel // CHUNK)

    def active(self, step: int, numel: int, world_size: int) -> bool:
        dense = 2 * 4 * numel / max(1, world_size)
        return self.payload_bytes(numel) < dense

    def quantize(
        self, x: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes ``0..2s`` (uint8, unpacked) and per-chunk scales for ``x``."""
        n = x.numel()
        chunks = -(-n // CHUNK)
        padded = torch.zeros(chunks * CHUNK, dtype=torch.float32)
        padded[:n] = x
        grid = padded.view(chunks, CHUNK)
        scales = grid.abs().amax(dim=1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        y = grid / safe[:, None] * self.levels
        low = torch.floor(y)
        noise = torch.rand(y.shape, generator=generator)
        q = low + (noise < (y - low)).to(torch.float32)
        q = q.clamp_(-self.levels, self.levels).add_(self.levels)
        return q.reshape(-1)[:n].to(torch.uint8), scales

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
        chunks = scales.numel()
        values = torch.zeros(chunks * CHUNK, dtype=torch.float32)
        values[:n] = codes.to(torch.float32) - self.levels
        grid = values.view(chunks, CHUNK) * (scales[:, None] / self.levels)
        return grid.reshape(-1)[:n]

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes
        if codes.numel() % 2:
            codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
        pairs = codes.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)

    def _unpack(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        if self.bits == 8:
            return packed[:n]
        out = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
        return out[:n]

    def encode(
        self,
        grad: torch.Tensor,
        buffers: Mapping[str, torch.Tensor],
        step: int,
        generator: torch.Generator,
    ) -> Encoded:
        corrected = buffers["residual"] + grad
        n = corrected.numel()
        codes, scales = self.quantize(corrected, generator)
        decoded = self.dequantize(codes, scales, n)
        payload = torch.cat([self._pack(codes), scales.view(torch.uint8)])
        return Encoded(
            payload,
            corrected,
            commit={"residual": corrected - decoded},
            flush={"residual": torch.zeros_like(corrected)},
        )

    def dense(
        self, grad: torch.Tensor, buffers: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return buffers["residual"] + grad, {"residual": torch.zeros_like(grad)}

    def decode_sum(self, gathered: torch.Tensor, numel: int, step: int) -> torch.Tensor:
        code_len = self.code_bytes(numel)
        out = torch.zeros(numel, dtype=torch.float32)
        for row in gathered:
            codes = self._unpack(row[:code_len], numel)
            scales = row[code_len:].clone().view(torch.float32)
            out += self.dequantize(codes, scales, numel)
        return out
