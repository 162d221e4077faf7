"""Unpacking of integers stored several to a 32-bit word (GPTQ, AWQ, compressed-tensors'
pack-quantized): shared by those formats, not a format of its own.

A word holds 32 / bits values, value i at bits [i * bits, (i + 1) * bits) (little-endian, as
every packer of these libraries writes them with shifts). The words are read as their four
bytes (a view, no arithmetic on int32): 8-bit values are the bytes, 4-bit values a byte's low
then high nibble. Only these two widths are read.

Legend: W = words along the packed dimension, N = the other dimension, k = 32 / bits values
per word.
"""

from __future__ import annotations

import sys

import torch

WIDTHS = (4, 8)
#: AutoAWQ's order: output channel k of a word's 8 -> its nibble (awq.py)
AWQ_REVERSE = (0, 4, 1, 5, 2, 6, 3, 7)


def _values(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [..., W] int32 -> values [..., W, k] uint8 in word order."""
    if bits not in WIDTHS:
        raise ValueError(f"packed integers of {bits} bits are not read; supported widths: {WIDTHS}")
    if sys.byteorder != "little":  # pragma: no cover - every machine this runs on is little-endian
        raise ValueError("packed int32 weights are read as little-endian bytes; this machine is big-endian")
    if words.stride(-1) != 1:  # e.g. a [N, 1] view with another stride: a dense copy to view as bytes
        words = torch.empty_like(words, memory_format=torch.contiguous_format).copy_(words)
    b = words.contiguous().view(torch.uint8).unflatten(-1, (-1, 4))  # [..., W, 4]
    if bits == 8:
        return b
    return torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)  # [..., W, 8]


def unpack_cols(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [N, W] packed along columns -> values [N, W * k] uint8 (value j of row n at column j)."""
    return _values(words, bits).flatten(-2)  # [N, W*k]


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """words [W, N] packed along rows -> values [W * k, N] uint8 (value i of column n at row i)."""
    v = _values(words, bits)  # [W, N, k]
    return v.permute(0, 2, 1).reshape(-1, words.shape[-1])  # [W*k, N]
