"""How a pseudo-gradient travels between sites: float32, bf16, 8 or 4 bits (pure).

Runs in the training process.  The narrow forms are blockwise: each block of
:data:`BLOCK` values carries one float32 scale, its largest magnitude.  Two
4-bit forms exist:

* ``e3m0``, the 4-bit float of Streaming DiLoCo (Douillard et al. 2025, section
  2.4): a sign bit and 3 exponent bits, no mantissa.  A code stands for 0 or
  ``scale * 2**-k`` for k in 0..6, so the levels are dense near 0 and sparse
  near the block's largest value, as pseudo-gradients are (most values small, a
  few large).  A value goes to the level nearest it on the number line (not in
  log space): the error of each value is the least it can be, which is what
  the sites' average adds up; a value halfway between two levels goes to the
  larger, and one below ``scale * 2**-7`` to 0.
* ``4bit``, uniform integers -7..7 times ``scale / 7``, rounded to the nearest
  step: even spacing, better where the values of a block are of one size.

``8bit`` is the uniform form with -127..127.  Rounding is deterministic and
decoding multiplies by the scale alone, so every site decodes every site's
payload to the same numbers and their averages agree bit for bit.  4-bit codes
take two to a byte.  The wire size per value: 4 bytes, 2, 1 + 4/256, and
0.5 + 4/256 for either 4-bit form.
``benchmarks/outer_quantization_error.py`` measures their error.
"""

from __future__ import annotations

import math

import torch

from orchestrator.spec.sync import OuterQuantization

__all__ = [
    "BLOCK",
    "E3M0_LEVELS",
    "Payload",
    "decode",
    "empty_like_payload",
    "encode",
    "payload_bytes",
]

#: Values per scale of the blockwise forms.
BLOCK = 256

#: The largest integer of each uniform form (symmetric: -top .. top).
_TOP = {OuterQuantization.INT8: 127, OuterQuantization.INT4: 7}

#: The blockwise forms whose codes take half a byte.
_NIBBLES = (OuterQuantization.INT4, OuterQuantization.E3M0)

#: ``e3m0``'s magnitudes, by the 3 bits of a code: 0, then 2**-6 .. 2**0 of the scale.
E3M0_LEVELS = torch.tensor([0.0] + [2.0**-k for k in range(6, -1, -1)])
#: The midpoints between consecutive levels: a magnitude at or above ``_E3M0_EDGES[i]``
#: takes level ``i + 1`` (exact in float32: each is 2**-7 or 3 * 2**-k).
_E3M0_EDGES = (E3M0_LEVELS[:-1] + E3M0_LEVELS[1:]) / 2
#: A code's sign bit (over its 3 exponent bits).
_SIGN = 8

#: What travels: one or two tensors (the codes, then the scales of a blockwise form).
Payload = list[torch.Tensor]


def payload_bytes(numel: int, kind: OuterQuantization) -> int:
    """Bytes of :func:`encode`'s payload for ``numel`` values."""
    if kind is OuterQuantization.NONE:
        return 4 * numel
    if kind is OuterQuantization.BF16:
        return 2 * numel
    blocks = math.ceil(numel / BLOCK)
    padded = blocks * BLOCK
    values = padded // 2 if kind in _NIBBLES else padded
    return values + 4 * blocks


def encode(flat: torch.Tensor, kind: OuterQuantization) -> Payload:
    """``flat`` (1-D float32) in ``kind``'s form."""
    if kind is OuterQuantization.NONE:
        return [flat.float().contiguous()]
    if kind is OuterQuantization.BF16:
        return [flat.to(torch.bfloat16)]
    blocks = math.ceil(flat.numel() / BLOCK)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    rows = padded.view(blocks, BLOCK)
    largest = rows.abs().amax(dim=1)
    if kind is OuterQuantization.E3M0:
        return [_pack(_e3m0_codes(rows, largest)), largest]
    top = _TOP[kind]
    scales = largest / top
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe[:, None]).clamp_(-top, top).to(torch.int16)
    if kind is OuterQuantization.INT8:
        return [q.to(torch.int8).reshape(-1), scales]
    return [_pack(q + 8), scales]  # 1..15


def _e3m0_codes(rows: torch.Tensor, largest: torch.Tensor) -> torch.Tensor:
    """Each value's 4-bit code: the sign bit over the index of its nearest level."""
    safe = torch.where(largest > 0, largest, torch.ones_like(largest))
    magnitude = rows.abs() / safe[:, None]  # 0..1; a block's largest value is exactly 1
    level = torch.bucketize(magnitude, _E3M0_EDGES, right=True)  # a tie takes the larger
    negative = (rows < 0) & (level > 0)  # 0 has one code
    return level + _SIGN * negative.to(level.dtype)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (0..15), two to a byte: the first in the low half."""
    nibbles = codes.to(torch.uint8).reshape(-1, 2)
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).contiguous()


def _unpack(values: torch.Tensor) -> torch.Tensor:
    """The codes :func:`_pack` packed, as int64."""
    low = (values & 0x0F).to(torch.int64)
    high = (values >> 4).to(torch.int64)
    return torch.stack([low, high], dim=1).reshape(-1)


def decode(payload: Payload, kind: OuterQuantization, numel: int) -> torch.Tensor:
    """The float32 values of a payload :func:`encode` made from ``numel`` values."""
    if kind in (OuterQuantization.NONE, OuterQuantization.BF16):
        return payload[0].float()
    values, scales = payload
    if kind is OuterQuantization.INT8:
        q = values.to(torch.float32)
    elif kind is OuterQuantization.INT4:
        q = (_unpack(values) - 8).to(torch.float32)
    else:
        codes = _unpack(values)
        signs = 1.0 - 2.0 * (codes >= _SIGN).to(torch.float32)
        q = E3M0_LEVELS[codes % _SIGN] * signs
    rows = q.view(-1, BLOCK) * scales[:, None]
    return rows.reshape(-1)[:numel].clone()


def empty_like_payload(numel: int, kind: OuterQuantization) -> Payload:
    """Buffers to receive a payload of ``numel`` values in ``kind``'s form."""
    if kind is OuterQuantization.NONE:
        return [torch.empty(numel, dtype=torch.float32)]
    if kind is OuterQuantization.BF16:
        return [torch.empty(numel, dtype=torch.bfloat16)]
    blocks = math.ceil(numel / BLOCK)
    values = blocks * BLOCK // 2 if kind in _NIBBLES else blocks * BLOCK
    dtype = torch.int8 if kind is OuterQuantization.INT8 else torch.uint8
    return [torch.empty(values, dtype=dtype), torch.empty(blocks, dtype=torch.float32)]
