"""The host attention backend ("host" in worker/attention_backends.py's registry): attention
of one micro-batch on the host CPU, over the paged KV pool in place (no per-step gather of
whole contexts). Only the micro-batch's queries and attention outputs cross between the
compute device and the host; its new K/V are stored into the pool first.

Legend: t = rows of the micro-batch, Hq / Hkv = query / key-value heads, D / Dv = key /
value head dim, c = context positions of one sequence, nb = blocks of one sequence.

Decoding rows run in one call of the native kernel (moecc_runtime.native: one work item per
row and KV head, each key and value read once, threads sharing the items), and with them every
row of a prompt chunk of NATIVE_PROMPT_ROWS rows or more (the kernel groups a chunk's
consecutive rows into one item). Shorter fresh prompts (a row group of one sequence starting
at position 0: its new K/V are its whole context) run without a gather: in bf16 on a CPU with
AMX those of AMX_PROMPT_ROWS rows or more in one call of the AMX prompt kernel
(native/prompt_amx.py), in fp32 on a CPU with AVX-512 all of them in one call of the fp32 prompt
kernel (native/prompt_fp32.py), the others of equal length batched, one causal SDPA call per
batch (kernels.attend_prompts). Any other prompt chunk gathers its own sequence's blocks on the
host and runs causal SDPA over them: its O(n^2) compute dwarfs reading its context once.
Without the native kernel (not built, or a K/V dtype it does not read), the decoding rows
go through the gathered path on the host instead (same numerics as GatheredAttention).
Multi-head attention (GQA included) and absorbed latent attention (MLA) both.

On CUDA the queries and new K/V go to the host in one batch of non-blocking copies on the
device->host stream (into pinned memory); the host waits on that batch's event, stores the
K/V into the (pinned) pool, attends, and sends the outputs back from pinned memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from moecc_runtime import native
from moecc_runtime.contract.plan_types import Op
from moecc_runtime.memory.kv import KVPool
from moecc_runtime.memory.streaming import KVStaging
from moecc_runtime.native import prompt_amx, prompt_fp32
from moecc_runtime.native.isa import cpu_flags
from moecc_runtime.worker import kernels
from moecc_runtime.worker.attention import attend_decode, blocks_needed, kv_view, project_qkv
from moecc_runtime.worker.batch import MicroBatch


def _native_prompt_rows() -> int | None:
    """NATIVE_PROMPT_ROWS's default: 256, or None on a CPU with AMX tiles, where torch's SDPA runs
    its products on them and the kernel (AVX-512 at most) loses: prompts of 300 and 600 tokens ran
    0.37x and 0.23x SDPA's speed through it in bf16, 0.89x and 0.69x in fp32, on an AMX Xeon
    (`python bench/attention.py --prompts 300,600`). MOECC_NATIVE_PROMPT_ROWS overrides (0: none)."""
    env = os.environ.get("MOECC_NATIVE_PROMPT_ROWS", "").strip()
    if env:
        return int(env) or None
    return None if "amx_tile" in cpu_flags() else 256


#: prompt chunks of at least this many rows attend through the native kernel with the decoding
#: rows (a group of a prompt's rows shares each key and value load; 1.2-1.8x torch's SDPA at 300-600
#: tokens on an AMD Zen 4, bench/results/README.md); None: none do. Shorter ones keep SDPA, which in
#: bf16 rounds as transformers' own prefill does (the kernel's fp32 softmax and sums round once, at
#: the end, so a bf16 model's logits move by bf16 rounding); there the kernel would buy little anyway
NATIVE_PROMPT_ROWS: int | None = _native_prompt_rows()


def _amx_prompt_rows() -> int | None:
    """AMX_PROMPT_ROWS's default: 256, the native kernel's threshold on a CPU without AMX (the same
    trade: its own rounding for the prompts long enough to gain). MOECC_AMX_PROMPT_ROWS overrides
    (0: none)."""
    env = os.environ.get("MOECC_AMX_PROMPT_ROWS", "").strip()
    return (int(env) or None) if env else 256


#: fresh prompts of at least this many rows attend on AMX tiles in bf16 (native/prompt_amx.py:
#: 2.2-2.7x torch's SDPA for 16 prompts of 300-600 tokens on an AMX Xeon, `python
#: bench/attention.py --prompts 300,450,600 --seqs 16 --dtypes bfloat16`); None: none do. Shorter
#: ones keep SDPA, which rounds as transformers' own prefill does
AMX_PROMPT_ROWS: int | None = _amx_prompt_rows()


#: fresh prompts of at least this many rows attend through the fp32 prompt kernel on AVX-512
#: (native/prompt_fp32.py): every one (1.4-3x torch's SDPA from 16 to 600 tokens on an AMX Xeon,
#: its rounding fp32's: bench/results/README.md, thirteenth pass)
FP32_PROMPT_ROWS: int | None = 2


def prompt_kernel(dtype: torch.dtype) -> tuple[Any, int | None]:
    """The fresh-prompt kernel for `dtype` and the fewest rows a prompt needs to go through it
    (None: no kernel)."""
    if dtype == torch.bfloat16:
        return prompt_amx, AMX_PROMPT_ROWS
    if dtype == torch.float32:
        return prompt_fp32, FP32_PROMPT_ROWS
    return None, None


@dataclass
class HostView:
    """The rows of a micro-batch the native kernel computes (one window): every decoding row,
    and every row of the prompt chunks of at least `prompt_rows` rows."""

    rows: torch.Tensor  # [n] local rows the kernel computes
    tables: torch.Tensor  # concatenated block tables of those rows (a chunk's once, shared by its rows)
    table_off: torch.Tensor  # [t] where row r's table starts in `tables`
    ctx: torch.Tensor  # [t] positions 0..ctx-1 exist
    lo: torch.Tensor  # [t] first position attended (sliding window)
    prefill: list[tuple[int, int, int, torch.Tensor]]  # (lo row, hi row, start position, [nb] blocks) per other prompt chunk


def host_view(mb: MicroBatch, window: int | None, bs: int, prompt_rows: int | None = None) -> HostView:
    """Built once per micro-batch and window (cached beside its KV views; one backend asks,
    always with the same `prompt_rows`: None keeps every prompt chunk out of the kernel)."""
    return mb.views.get(HostView, window, "cpu", lambda: _build_host_view(mb, window, bs, prompt_rows))


def _build_host_view(mb: MicroBatch, window: int | None, bs: int, prompt_rows: int | None) -> HostView:
    t = mb.r1 - mb.r0
    rows: list[int] = []
    tables: list[int] = []
    off, ctx, lo = [0] * t, [0] * t, [0] * t
    prefill = []
    for idx, (_, row, start, n) in enumerate(mb.items):
        c = start + n
        table = mb.tables[idx][:blocks_needed(c, bs)]
        if n > 1 and (prompt_rows is None or n < prompt_rows):
            prefill.append((row, row + n, start, torch.tensor(table, dtype=torch.long)))
            continue
        for i in range(n):  # a chunk's row i sees positions up to start + i (causal)
            rows.append(row + i)
            off[row + i], ctx[row + i] = len(tables), start + i + 1
            lo[row + i] = 0 if window is None else max(0, start + i + 1 - window)
        tables.extend(table)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return HostView(as_long(rows), as_long(tables), as_long(off), as_long(ctx), as_long(lo), prefill)


class HostAttention:
    """Attention on the host over the KV pool in place; q/k/v projections and the output
    projection run where the compute is (the device, or the host on a CPU-only machine).
    An attention_backends.AttentionBackend that does not gather."""

    gathers = False  # reads the pool in place: the worker stages no KV for its micro-batches

    def __init__(self, pool: KVPool, pin: bool = False):
        """`pin`: the compute device is a GPU (attention outputs go back from pinned memory)."""
        self.pool = pool
        self.pin = pin
        self.native = native.supports(pool.k.dtype)
        self._gather = KVStaging(pool, torch.device("cpu"))  # the fallback's gather (one growing host buffer)
        self._sinks: dict[str, torch.Tensor] = {}  # device attention sinks' host copies, by op (weights)

    @property
    def _prompt_rows(self) -> int | None:
        """Prompt chunks of at least this many rows go through the kernel (None: it is off)."""
        return NATIVE_PROMPT_ROWS if self.native else None

    def prepare(self, mb: MicroBatch, window: int | None) -> None:
        """Build `mb`'s host view for `window` (the native kernel's index tensors, on the host)."""
        host_view(mb, window, self.pool.block_size, self._prompt_rows)

    def forward(self, op: Op, x: torch.Tensor, rope: torch.Tensor, mb: MicroBatch, w: dict[str, torch.Tensor],
                kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x [t, H] -> [t, H]; the micro-batch's new K/V are in the pool afterwards. `kv`:
        unused (the pool is read in place)."""
        a = op.attrs
        q, k, v, finish = project_qkv(op, x, w, rope)
        layer = a["layer_index"]
        if q.is_cuda and self.pool.d2h is not None:  # kv_store and the queries: one batch, one event
            (hk, hv, qh), ready = self.pool.d2h.start(k, v, q)
            self.pool.defer(layer, mb.write_blocks, mb.write_offsets, hk, hv, ready)
            self.pool.flush(layer)  # waits on the event, then writes this layer's K/V into the pool
        else:
            self.pool.store(layer, mb.write_blocks, mb.write_offsets, k, v)  # kv_store
            qh, hk, hv = q.to("cpu"), k, v  # [t, Hq, D]: only the queries cross
        out = self._attend(qh, layer, mb, a, self._host_sinks(op, w.get("sinks")), (hk, hv))  # [t, Hq, Dv] on the host
        out = out.to(device=x.device, non_blocking=self.pin and x.is_cuda)  # from pinned memory on CUDA
        out = out.to(dtype=q.dtype).reshape(x.shape[0], -1)  # [t, Hq*Dv]
        if finish is not None:
            return finish(out)
        return kernels.linear(out, w["o"], w.get("o_bias"))

    def _host_sinks(self, op: Op, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The op's attention sinks on the host (a weight: copied from the device once)."""
        if sinks is None or not sinks.is_cuda:
            return sinks
        h = self._sinks.get(op.name)
        if h is None:
            h = self._sinks[op.name] = sinks.to("cpu")
        return h

    def _pools(self, layer: int, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K and V pools [Hkv, NB, bs, D|Dv] (latent attention: V is K's latent part)."""
        k = self.pool.k[layer]
        v = self.pool.v[layer] if self.pool.v.shape[-1] else k[..., :a["kv_lora_rank"]]
        return k, v

    def _attend(self, q: torch.Tensor, layer: int, mb: MicroBatch, a: dict,
                sinks: torch.Tensor | None, new_kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Every row of the micro-batch; `new_kv`: its new K/V on the host ([t, Hkv, D|Dv]),
        which are the whole context of a fresh prompt."""
        window = a.get("sliding_window")
        view = host_view(mb, window, self.pool.block_size, self._prompt_rows)
        kp, vp = self._pools(layer, a)
        # [t, Hq, Dv] in the queries' dtype where the kernel writes it (fp32, bf16: the bits of
        # fp32 rounded as torch rounds them), so prompt rows from SDPA are copied, not widened
        # and narrowed again
        odt = q.dtype if q.dtype in native.KV_DTYPES else torch.float32
        out = torch.empty((q.shape[0], q.shape[1], vp.shape[-1]), dtype=odt, pin_memory=self.pin)
        if view.rows.numel():
            if self.native:
                native.paged_attention(native.kernel_queries(q), kp, vp, view.rows, view.tables, view.table_off,
                                       view.ctx, view.lo, a["scaling"], out, sinks)
            else:
                self._decode_gathered(q, layer, mb, a, sinks, out)
        prefill = view.prefill
        if sinks is None and new_kv[1].shape[-1] == q.shape[-1]:  # MHA without sinks (not MLA)
            fresh = [(lo, hi) for lo, hi, start, _ in prefill if start == 0 and (window is None or hi - lo <= window)]
            if fresh:
                k, v = new_kv
                done = self._attend_fresh(q, k.to(q.dtype), v.to(q.dtype), fresh, a["scaling"], out)
                prefill = [p for p in prefill if (p[0], p[1]) not in done]
        for lo, hi, start, idx in prefill:
            c = start + (hi - lo)
            ks = kp.index_select(1, idx).flatten(1, 2)[:, :c]  # [Hkv, c, D]: this sequence's context
            vs = vp.index_select(1, idx).flatten(1, 2)[:, :c]
            o = kernels.attend(q[lo:hi], ks, vs, start, a, sinks)  # [n, Hq*Dv]
            out[lo:hi] = o.view(hi - lo, q.shape[1], -1)
        return out

    @staticmethod
    def _attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fresh: list[tuple[int, int]], scale: float,
                      out: torch.Tensor) -> set[tuple[int, int]]:
        """Fresh prompts (rows [lo, hi), their whole context) attended without a gather: those of at
        least the dtype's rows (prompt_kernel) through its kernel where it takes them (bf16 on AMX
        tiles, fp32 on AVX-512), the rest batched through SDPA where two or more are left. Returns
        the spans done."""
        done: set[tuple[int, int]] = set()
        kernel, rows = prompt_kernel(q.dtype)
        long = [s for s in fresh if rows and s[1] - s[0] >= rows]
        if long and kernel.attend(q, k, v, long, scale, out):
            done.update(long)
        rest = [s for s in fresh if s not in done]
        if len(rest) > 1:
            kernels.attend_prompts(q, k, v, rest, scale, out)
            done.update(rest)
        return done

    def _decode_gathered(self, q: torch.Tensor, layer: int, mb: MicroBatch, a: dict,
                         sinks: torch.Tensor | None, out: torch.Tensor) -> None:
        """The fallback: gather the decoding rows' blocks on the host, then grouped SDPA."""
        kview = kv_view(mb, a.get("sliding_window"), self.pool.block_size)
        hk, hv = self._gather.acquire(None, layer, kview.blocks)  # [Hkv, nb, bs, D], [Hkv, nb, bs, Dv]
        kbuf, vbuf = (hk, hk[..., :a["kv_lora_rank"]]) if not hv.shape[-1] else (hk, hv)
        flat = out.view(out.shape[0], -1)
        attend_decode(flat, q, kbuf, vbuf, kview, a, sinks)
