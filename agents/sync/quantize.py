"""How a pseudo-gradient travels between sites: float32, bf16, 8 or 4 bits (pure).

Runs in the training process.  Integer forms are blockwise: each block of
:data:`BLOCK` values carries one float32 scale (its largest magnitude over
the integer range), and values are rounded to the nearest step.  Rounding is
deterministic, so every site decodes every site's payload to the same
numbers and their averages agree bit for bit.  4-bit values take two to a
byte.  The wire size per value: 4 bytes, 2, 1 + 4/256, 0.5 + 4/256.
"""

from __future__ import annotations

import math

import torch

from orchestrator.spec.sync import OuterQuantization

__all__ = ["BLOCK", "Payload", "decode", "empty_like_payload", "encode", "payload_bytes"]

#: Values per scale of the integer forms.
BLOCK = 256

#: The largest integer of each integer form (symmetric: -top .. top).
_TOP = {OuterQuantization.INT8: 127, OuterQuantization.INT4: 7}

#: What travels: one or two tensors (the values, then the scales of an integer form).
Payload = list[torch.Tensor]


def payload_bytes(numel: int, kind: OuterQuantization) -> int:
    """Bytes of :func:`encode`'s payload for ``numel`` values."""
    if kind is OuterQuantization.NONE:
        return 4 * numel
    if kind is OuterQuantization.BF16:
        return 2 * numel
    blocks = math.ceil(numel / BLOCK)
    padded = blocks * BLOCK
    values = padded if kind is OuterQuantization.INT8 else padded // 2
    return values + 4 * blocks


def encode(flat: torch.Tensor, kind: OuterQuantization) -> Payload:
    """``flat`` (1-D float32) in ``kind``'s form."""
    if kind is OuterQuantization.NONE:
        return [flat.float().contiguous()]
    if kind is OuterQuantization.BF16:
        return [flat.to(torch.bfloat16)]
    top = _TOP[kind]
    blocks = math.ceil(flat.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, BLOCK)
    scales = rows.abs().amax(dim=1) / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-top, top).to(torch.int16)
    if kind is OuterQuantization.INT8:
        return [q.to(torch.int8).reshape(-1), scales]
    nibbles = (q + 8).to(torch.uint8).reshape(-1, 2)  # 1..15, two per byte
    return [(nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous(), scales]


def decode(payload: Payload, kind: OuterQuantization, numel: int) -> torch.Tensor:
    """The float32 values of a payload :func:`encode` made from ``numel`` values."""
    if kind in (OuterQuantization.NONE, OuterQuantization.BF16):
        return payload[0].float()
    values, scales = payload
    if kind is OuterQuantization.INT8:
        q = values.to(torch.float32)
    else:
        low = (values & 0x0F).to(torch.int16) - 8
        high = (values >> 4).to(torch.int16) - 8
        q = torch.stack([low, high], dim=1).reshape(-1).to(torch.float32)
    rows = q.view(-1, BLOCK) * scales[:, None]
    return rows.reshape(-1)[:numel].clone()


def empty_like_payload(numel: int, kind: OuterQuantization) -> Payload:
    """Buffers to receive a payload of ``numel`` values in ``kind``'s form."""
    if kind is OuterQuantization.NONE:
        return [torch.empty(numel, dtype=torch.float32)]
    if kind is OuterQuantization.BF16:
        return [torch.empty(numel, dtype=torch.bfloat16)]
    blocks = math.ceil(numel / BLOCK)
    values = blocks * BLOCK if kind is OuterQuantization.INT8 else blocks * BLOCK // 2
    dtype = torch.int8 if kind is OuterQuantization.INT8 else torch.uint8
    return [torch.empty(values, dtype=dtype), torch.empty(blocks, dtype=torch.float32)]
