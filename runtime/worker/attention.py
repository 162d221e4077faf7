"""The device attention backend ("device" in worker/attention_backends.py's registry):
attention of one micro-batch over the paged KV cache, where the compute is.

Legend: t = rows of the micro-batch, S = sequences of one decode group, nb = KV blocks
gathered for the micro-batch, bs = block size, c = context positions of one sequence, Hq /
Hkv = query / key-value heads, G = Hq / Hkv, D / Dv = key / value head dim.

`GatheredAttention`: the micro-batch's blocks are gathered into one buffer on the compute
device (by memory/streaming.py's KVStaging, before the micro-batch runs), its new K/V are
written to the host pool (on CUDA asynchronously: KVPool.store) and into that buffer, and
attention runs there: decoding sequences grouped by how many blocks they span (one batched
call per group, masking only the unused tail of each sequence's last block, never padding
to the longest), prefill chunks one sequence at a time with a causal mask. Which blocks a
micro-batch reads, per sliding window, is its `KVView`. A view is built once per
micro-batch, window and device (`prepare`, cached in `MicroBatch.views`), so every layer of
the step shares its index tensors: they are made on the host and sent to the device once
(syncs.to_device: no stall), never copied per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moecc_runtime.contract.plan_types import Op
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.syncs import to_device
from moecc_runtime.worker import kernels
from moecc_runtime.worker.batch import MicroBatch


@dataclass
class DecodeGroup:
    """Decoding sequences of a micro-batch that span the same number of KV blocks."""

    rows: torch.Tensor  # [S] their rows in the micro-batch (on the view's device)
    first: int  # their blocks' offset in the gathered buffer
    S: int
    n: int  # blocks per sequence
    mask: torch.Tensor  # [S, n*bs] True where a key position may be attended (on the view's device)


@dataclass
class PrefillChunk:
    lo: int  # rows lo..hi-1 of the micro-batch
    hi: int
    start: int  # position of row lo
    first: int  # blocks' offset in the gathered buffer
    nblocks: int


@dataclass
class KVView:
    blocks: torch.Tensor  # [nb] physical blocks to gather, in buffer order (on the host: the gather reads it)
    decode_groups: list[DecodeGroup]
    prefill: list[PrefillChunk]
    new_blocks: torch.Tensor  # [t] where each row's new K/V lies in the gathered buffer: block (view's device)
    new_offsets: torch.Tensor  # [t] and offset in it (view's device)


def blocks_needed(ctx: int, bs: int) -> int:
    return -(-ctx // bs)


def kv_view(mb: MicroBatch, window: int | None, bs: int, device: torch.device = torch.device("cpu")) -> KVView:
    """Which blocks attention of `mb` reads, per sliding-window size (None = full), with its
    index tensors on `device`; built once per micro-batch, window and device."""
    return mb.views.get(KVView, window, device.type, lambda: _build_view(mb, window, bs, device))


def _build_view(mb: MicroBatch, window: int | None, bs: int, device: torch.device) -> KVView:
    """Prefill chunks first (their whole context), then the decoding sequences by blocks spanned."""
    blocks: list[int] = []
    by_n: dict[int, list[tuple[int, int, int]]] = {}  # n blocks -> (item index, first block, ctx)
    prefill: list[PrefillChunk] = []
    t = mb.r1 - mb.r0
    new_b, new_o = [0] * t, [0] * t
    for idx, (_, row, start, n) in enumerate(mb.items):
        ctx = start + n
        if n == 1:
            lo = 0 if window is None else max(0, ctx - window) // bs
            by_n.setdefault(blocks_needed(ctx, bs) - lo, []).append((idx, lo, ctx))
            continue
        nb = blocks_needed(ctx, bs)
        prefill.append(PrefillChunk(row, row + n, start, len(blocks), nb))
        for i in range(n):
            new_b[row + i], new_o[row + i] = len(blocks) + (start + i) // bs, (start + i) % bs
        blocks.extend(mb.tables[idx][:nb])
    groups = [_decode_group(mb, members, nblk, window, bs, blocks, new_b, new_o, device)
              for nblk, members in sorted(by_n.items())]
    return KVView(torch.tensor(blocks, dtype=torch.long), groups, prefill,
                  to_device(new_b, device, torch.long), to_device(new_o, device, torch.long))


def _decode_group(mb: MicroBatch, members: list[tuple[int, int, int]], nblk: int, window: int | None, bs: int,
                  blocks: list[int], new_b: list[int], new_o: list[int], device: torch.device) -> DecodeGroup:
    """Append the blocks of decoding sequences spanning `nblk` blocks to `blocks` (and where
    their new K/V lie to new_b / new_o); their group with its key mask."""
    first = len(blocks)
    kpos = []
    for idx, lo, ctx in members:
        row = mb.items[idx][1]
        new_b[row], new_o[row] = len(blocks) + (ctx - 1) // bs - lo, (ctx - 1) % bs
        blocks.extend(mb.tables[idx][lo:lo + nblk])
        kpos.append((lo * bs, ctx))
    base = torch.tensor([p for p, _ in kpos])[:, None]  # [S, 1]
    ctxs = torch.tensor([c for _, c in kpos])[:, None]  # [S, 1]
    pos = base + torch.arange(nblk * bs)[None, :]  # [S, n*bs]
    mask = pos < ctxs
    if window is not None:
        mask &= pos > ctxs - 1 - window
    rows = [mb.items[idx][1] for idx, _, _ in members]
    return DecodeGroup(to_device(rows, device, torch.long), first, len(members), nblk, to_device(mask, device))


def project_qkv(op: Op, x: torch.Tensor, w: dict[str, torch.Tensor], rope: torch.Tensor):
    """The attention op's queries, new keys and values for x [t, H], and `finish` (latent
    attention: maps its output through W_UV and o_proj; None: multi-head attention, whose
    output goes through o_proj). MHA: [t, Hq, D], [t, Hkv, D] x2; MLA: [t, nh, kl+R],
    [t, 1, kl+R], [t, 1, 0]."""
    a = op.attrs
    variant = a.get("variant", "mha")
    if variant == "mla":
        return kernels.mla_qkv(x, w, a, rope)
    if variant == "mha":
        return (*kernels.attention_qkv(x, w, a, rope), None)
    raise RuntimeError(f"runtime: attention variant {variant!r} (node {op.name}) is not "
                       f"implemented by this runtime")


class GatheredAttention:
    """Attention on the compute device over the micro-batch's KV gathered there (an
    attention_backends.AttentionBackend that gathers)."""

    gathers = True  # the worker's KV staging brings the micro-batch's blocks to the device first

    def __init__(self, pool: KVPool, device: torch.device = torch.device("cpu")):
        """`device`: the compute device (where the views' index tensors go)."""
        self.pool = pool
        self.device = torch.device(device)

    def prepare(self, mb: MicroBatch, window: int | None) -> torch.Tensor:
        """Build `mb`'s view for `window` (index tensors sent to the device once per step);
        [nb] the pool blocks attention of `mb` reads (what KV staging gathers for it)."""
        return kv_view(mb, window, self.pool.block_size, self.device).blocks

    def forward(self, op: Op, x: torch.Tensor, rope: torch.Tensor, mb: MicroBatch, w: dict[str, torch.Tensor],
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [t, H] -> [t, H]. kv: this layer's gathered blocks, [Hkv, nb, bs, D] and
        [Hkv, nb, bs, Dv]; `w` the op's weights. Multi-head attention, or latent attention
        (MLA: one cached "head" holding the latent and the rope key, values read from the
        latent part)."""
        a = op.attrs
        if kv is None:
            raise RuntimeError(f"runtime: device attention of node {op.name} got micro-batch {mb.index} without "
                               f"its gathered KV; the worker stages it (KVStaging) for every backend that gathers")
        q, k, v, finish = project_qkv(op, x, w, rope)
        # kv_store: on CUDA asynchronous (device->host stream, pinned), in the pool by the step's end
        self.pool.store(a["layer_index"], mb.write_blocks, mb.write_offsets, k, v)
        view = kv_view(mb, a.get("sliding_window"), self.pool.block_size, self.device)
        kbuf, vbuf = _store_new(kv, view, k, v, a)
        out = torch.empty((x.shape[0], q.shape[1] * vbuf.shape[-1]), dtype=q.dtype, device=q.device)  # [t, Hq*Dv]
        sinks = w.get("sinks")  # gpt-oss: one extra softmax logit per query head [Hq]
        attend_decode(out, q, kbuf, vbuf, view, a, sinks)
        for p in view.prefill:
            c = p.start + (p.hi - p.lo)  # context after this chunk
            ks = kbuf[:, p.first:p.first + p.nblocks].reshape(kbuf.shape[0], -1, kbuf.shape[-1])[:, :c]  # [Hkv, c, D]
            vs = vbuf[:, p.first:p.first + p.nblocks].reshape(vbuf.shape[0], -1, vbuf.shape[-1])[:, :c]
            out[p.lo:p.hi] = kernels.attend(q[p.lo:p.hi], ks, vs, p.start, a, sinks)
        if finish is not None:
            return finish(out)
        return kernels.linear(out, w["o"], w.get("o_bias"))


def _store_new(kv: tuple[torch.Tensor, torch.Tensor], view: KVView, k: torch.Tensor, v: torch.Tensor,
               a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the micro-batch's new K/V [t, Hkv, D] into the gathered buffers; the buffers to
    attend over (latent attention: the values are the latent part of the key)."""
    kbuf, vbuf = kv
    nb_idx, off = view.new_blocks, view.new_offsets  # [t] on the device
    kbuf[:, nb_idx, off] = k.transpose(0, 1).to(kbuf.dtype)  # [Hkv, t, D]
    if vbuf.shape[-1]:
        vbuf[:, nb_idx, off] = v.transpose(0, 1).to(vbuf.dtype)
    else:
        vbuf = kbuf[..., :a["kv_lora_rank"]]
    return kbuf, vbuf


def attend_decode(out: torch.Tensor, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, view: KVView,
                   a: dict, sinks: torch.Tensor | None) -> None:
    """Decoding rows, one batched call per group of sequences spanning the same blocks."""
    Hkv, bs, D, Dv = kbuf.shape[0], kbuf.shape[2], kbuf.shape[-1], vbuf.shape[-1]
    G = q.shape[1] // Hkv
    for g in view.decode_groups:
        kg = kbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * bs, D)  # [Hkv, S, c, D]
        vg = vbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * bs, Dv)
        qg = q[g.rows].view(g.S, Hkv, G, D).transpose(0, 1)  # [Hkv, S, G, D]
        if sinks is None:
            o = kernels.sdpa(qg, kg, vg, attn_mask=g.mask[None, :, None, :], scale=a["scaling"])  # [Hkv, S, G, Dv]
        else:  # [S, Hkv, G, 1, D] queries over [S, Hkv, 1, c, D] keys
            o = kernels.sink_attention(qg.transpose(0, 1)[:, :, :, None], kg.transpose(0, 1)[:, :, None],
                                       vg.transpose(0, 1)[:, :, None], g.mask[:, None, None, None, :],
                                       a["scaling"], sinks)[:, :, :, 0].transpose(0, 1)
        out[g.rows] = o.transpose(0, 1).reshape(g.S, -1).to(out.dtype)
