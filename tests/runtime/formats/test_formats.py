"""The stored weight formats (runtime/formats/) dequantize exactly: MXFP4 bit-identical to
transformers' own gpt-oss conversion; fine-grained FP8 equal to the block-by-block product,
with partial last blocks and slices that start mid-block (the up half of a fused gate_up)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moecc_runtime.formats import fp8_block, materialize, mxfp4


def test_mxfp4_matches_transformers_conversion():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(3, 64, 96)  # [E, 2I, H] as stored
    blocks, scales = (torch.stack(t) for t in zip(*(mxfp4.quantize(w[e]) for e in range(3))))
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, H, 2I]
    for e in range(3):
        entry = {"format": "mxfp4", "shape": [64, 3, 16], "logical_shape": [96, 64],
                 "format_attrs": {"transpose": True}}
        got = materialize(entry, {"data": blocks[e], "scale": scales[e]}, torch.bfloat16)
        assert torch.equal(got, ref[e])
        assert (got.float() - w[e].t()).abs().max() <= w[e].abs().max() / 4  # a coarse format, but close


def _fp8_reference(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], r0: int) -> torch.Tensor:
    out = torch.empty(data.shape, dtype=torch.float32)
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            out[i, j] = data[i, j].float() * scale[(r0 + i) // block[0], j // block[1]]
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), b_r=st.sampled_from((4, 8, 16)),
       b_c=st.sampled_from((4, 8, 16)), cut=st.integers(0, 39))
def test_fp8_block_dequantizes_block_by_block(rows, cols, b_r, b_c, cut):
    torch.manual_seed(rows * 41 + cols)
    w = torch.randn(rows, cols)
    data, scale = fp8_block.quantize(w, (b_r, b_c))
    assert tuple(scale.shape) == (-(-rows // b_r), -(-cols // b_c))  # partial last blocks have a scale
    r0 = cut % rows  # a slice from row r0 on (the up half of a fused gate_up starts mid-block)
    entry = {"format": "fp8_block", "shape": [rows - r0, cols], "logical_shape": [rows - r0, cols],
             "format_attrs": {"block": [b_r, b_c], "row0": r0 % b_r}}
    sub_scale = scale[r0 // b_r:]
    got = materialize(entry, {"data": data[r0:], "scale": sub_scale}, torch.float32)
    assert torch.equal(got, _fp8_reference(data[r0:], sub_scale, (b_r, b_c), r0 % b_r))
    assert torch.allclose(got, w[r0:], rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits
