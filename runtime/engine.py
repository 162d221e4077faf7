"""Execute a plan's module schedule over a batch of sequences (module-based batching).

Legend: T = rows (new tokens) in this step, S = sequences in the step, H = hidden size,
V = vocabulary, Hq / Hkv = query / key-value heads, G = Hq / Hkv, D = head dim,
bs = KV block size, c = context positions gathered for one sequence.

One step takes, for each sequence in flight, a number of its not-yet-cached tokens (a
prompt chunk being prefilled, or the one token it decodes) and runs them all together as
T rows, module by module in plan order:
  * attention modules run in micro-batches of b_a sequences: the micro-batch's new K/V are
    written into the paged host KV cache, its sequences' blocks are gathered into one
    buffer on the compute device, and attention runs there: decoding sequences grouped by
    how many blocks they span (one batched call per group, masking only the unused tail
    of each sequence's last block, never padding to the longest), prefill chunks one
    sequence at a time with a causal mask;
  * expert modules run every expert over all rows routed to it, in chunks of b_e rows;
    dense MLPs over all rows in chunks of b_e;
  * values that cross modules are kept in host buffers [T, ...].
Only the last row of each sequence whose known tokens are all cached after the step
reaches the head (final norm, lm_head).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from moecc_runtime import kernels
from moecc_runtime.kv import PagedKVCache
from moecc_runtime.weights import TORCH_DTYPES, WeightStore

TRANSFER_OPS = frozenset({"fetch_weights", "fetch_experts", "kv_load", "kv_store"})
DEFAULT_BLOCK_SIZE = 16


@dataclass
class Sequence:
    """One request in flight: its tokens and how many of them are in the KV cache."""

    sid: int
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    max_new: int
    cached: int = 0  # positions already in the KV cache
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def pending(self) -> int:
        """Tokens known but not yet run through the model."""
        return len(self.tokens) - self.cached


@dataclass
class StepRecord:
    """What one engine step did and how long it took (wall seconds)."""

    seconds: float
    sequences: int
    prefill_tokens: int
    decode_tokens: int
    experts_run: int
    kv_blocks_used: int
    kv_allocated_bytes: int
    kv_live_bytes: int


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    experts_run: int = 0
    seconds: float = 0.0
    peak_kv_allocated_bytes: int = 0
    peak_kv_live_bytes: int = 0
    records: list[StepRecord] | None = None  # per step, when the engine was asked to keep them


class Engine:
    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu",
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None,
                 kv_blocks: int | None = None, block_size: int | None = None, record_steps: bool = False):
        self.plan = plan
        self.info = plan["model"]["info"]
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[self.info["dtype"]]
        self.store = WeightStore(plan["weights"], model_dir, self.device)
        batch = plan["batch"]["decode"]
        self.b_e = int(expert_chunk or batch["b_e"])
        self.b_a = int(attn_micro_batch or batch["b_a"])
        self.inv_freq = plan["rope"]["inv_freq"].to(self.device)
        self.rope_scaling = float(plan["rope"]["attention_scaling"])
        self.schedule = plan["schedule"]
        self._producer = {op["name"]: op["op"] for m in self.schedule for op in m["ops"]}
        kv_plan = plan["batch"].get("kv", {})
        bs = int(block_size or kv_plan.get("block_size", DEFAULT_BLOCK_SIZE))
        seq_len = int(plan["batch"]["workload"]["seq_len"])
        nb = int(kv_blocks or kv_plan.get("num_blocks") or int(batch["B"]) * -(-seq_len // bs))
        i = self.info
        self.kv = PagedKVCache(i["num_layers"], i["num_kv_heads"], i["head_dim"], block_size=bs,
                               num_blocks=nb, dtype=self.dtype, device="cpu")
        self._kv_buf: tuple[torch.Tensor, torch.Tensor] | None = None  # gathered KV, reused
        self._host_bufs: dict[str, torch.Tensor] = {}  # host buffer storage by value name, reused
        self.stats = EngineStats(records=[] if record_steps else None)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Run `n` pending tokens of each (sequence, n) in `work`. Returns the sequences whose
        known tokens are now all cached and their next-token logits [S', V] (fp32).
        Raises KVCacheFull before computing anything if the pool cannot hold the step."""
        t0 = time.perf_counter()
        for s, n in work:
            if not 0 < n <= s.pending:
                raise ValueError(f"sequence {s.sid}: asked to run {n} of {s.pending} pending tokens")
            self.kv.reserve(s.sid, s.cached + n)
        b = _StepBatch.build(work, self.kv, self.device)
        env: dict[str, torch.Tensor] = {"input_ids": b.input_ids, "positions": b.positions}
        logits = None
        experts_before = self.stats.experts_run
        for module in self.schedule:
            kind = module["kind"]
            if kind == "attn":
                for mb in b.micro_batches(self.b_a, self.kv):
                    self._run_module(module, env, b, mb)
            else:
                out = self._run_module(module, env, b, None)
                if kind == "head":
                    logits = out
        for s, n in work:
            s.cached += n
        assert logits is not None, "plan has no head module"
        self._account(b, time.perf_counter() - t0, self.stats.experts_run - experts_before)
        return b.finishing, logits.float()

    def _account(self, b: "_StepBatch", seconds: float, experts: int) -> None:
        st, use = self.stats, self.kv.usage()
        st.steps += 1
        st.seconds += seconds
        st.tokens += b.T
        st.prefill_tokens += b.prefill_tokens
        st.decode_tokens += b.T - b.prefill_tokens
        st.peak_kv_allocated_bytes = max(st.peak_kv_allocated_bytes, use.allocated_bytes)
        st.peak_kv_live_bytes = max(st.peak_kv_live_bytes, use.live_bytes)
        if st.records is not None:
            st.records.append(StepRecord(seconds, len(b.work), b.prefill_tokens, b.T - b.prefill_tokens,
                                         experts, use.blocks_used, use.allocated_bytes, use.live_bytes))

    def release(self, seq: Sequence) -> None:
        """Free a finished (or preempted) sequence's KV blocks."""
        self.kv.release(seq.sid)

    def _run_module(self, module: dict, env: dict[str, torch.Tensor], b: "_StepBatch",
                    mb: "_MicroBatch | None") -> torch.Tensor | None:
        """Run one module's ops over the attention micro-batch `mb`, or over all rows (the
        head module reads only the finishing sequences' last rows)."""
        if mb is not None:
            rows: slice | torch.Tensor = slice(mb.r0, mb.r1)
        elif module["kind"] == "head":
            rows = b.last_rows
        else:
            rows = slice(None)
        local: dict[str, Any] = {}
        last = None

        def arg(name: str) -> Any:
            if name in local:
                return local[name]
            return env[name][rows].to(self.device)

        for op in module["ops"]:
            kind = op["op"]
            if kind in TRANSFER_OPS:
                continue  # CPU: weights are read in place; CUDA: fetched on first use (kept)
            inputs = [arg(i) for i in op["inputs"] if self._producer.get(i) not in TRANSFER_OPS]
            if kind == "host_buffer":
                full = env.get(op["name"])
                x = inputs[0]
                if full is None:  # [T, ...] on the host, filled micro-batch by micro-batch
                    full = env[op["name"]] = self._host_buffer(op["name"], (b.T, *x.shape[1:]), x.dtype)
                full[rows] = x.to("cpu")
                continue
            last = local[op["name"]] = self._compute(op, inputs, mb)
        return last

    def _host_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer's storage, kept across steps and grown when a step needs more, so
        big steps do not pay fresh page faults for every buffer."""
        need = 1
        for d in shape:
            need *= d
        buf = self._host_bufs.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = self._host_bufs[name] = torch.empty(max(need, 1), dtype=dtype, device="cpu")
        return buf[:need].view(shape)

    def _w(self, op: dict, local: str) -> torch.Tensor:
        return self.store.get(op["weights"][local])

    def _compute(self, op: dict, x: list[Any], mb: "_MicroBatch | None") -> Any:
        kind, a = op["op"], op["attrs"]
        if kind == "embed":
            return F.embedding(x[0], self._w(op, "weight"))
        if kind == "rope":
            return kernels.rope_table(x[0], self.inv_freq, self.rope_scaling, self.dtype)
        if kind == "rmsnorm":
            return kernels.rmsnorm(x[0], self._w(op, "weight"), a["eps"])
        if kind == "attention":
            assert mb is not None, f"attention node {op['name']} outside an attention module"
            return self._attention(op, x[0], x[1], mb)
        if kind == "router":
            return kernels.route(x[0], self._w(op, "weight"), a)
        if kind == "experts":
            top_w, top_i = x[1]

            def weights(e: int):
                return self._w(op, f"e{e}.gate"), self._w(op, f"e{e}.up"), self._w(op, f"e{e}.down")

            out, used = kernels.experts(x[0], top_w, top_i, weights, a["num_experts"], a["act"], self.b_e)
            self.stats.experts_run += used
            return out
        if kind == "mlp":
            out = torch.empty_like(x[0])
            for s in range(0, x[0].shape[0], self.b_e):
                out[s:s + self.b_e] = kernels.gated_mlp(x[0][s:s + self.b_e], self._w(op, "gate"),
                                                        self._w(op, "up"), self._w(op, "down"), a["act"])
            return out
        if kind == "linear":
            bias = self._w(op, "bias") if "bias" in op["weights"] else None
            return kernels.linear(x[0], self._w(op, "weight"), bias)
        if kind == "add":
            return x[0] + x[1]
        if kind == "mul":
            return x[0] * x[1]
        if kind == "sigmoid":
            return torch.sigmoid(x[0])
        if kind == "lm_head":
            return kernels.linear(x[0], self._w(op, "weight"))
        raise RuntimeError(f"runtime: op {kind!r} (node {op['name']}) is not implemented by this runtime; "
                           f"the plan is newer than the runtime")

    # -- attention over one micro-batch ------------------------------------------------------
    def _attention(self, op: dict, x: torch.Tensor, rope: torch.Tensor, mb: "_MicroBatch") -> torch.Tensor:
        a = op["attrs"]
        w = {k: self._w(op, k) for k in op["weights"]}
        q, k, v = kernels.attention_qkv(x, w, a, rope)  # [t, Hq, D], [t, Hkv, D] x2
        layer = a["layer_index"]
        self.kv.write(layer, mb.write_blocks, mb.write_offsets, k.to("cpu"), v.to("cpu"))  # new K/V to host
        view = mb.view(a.get("sliding_window"), self.kv.block_size)
        kbuf, vbuf = self._gather(layer, view.blocks)  # [Hkv, nb, bs, D] on the compute device
        Hkv, D = a["num_kv_heads"], a["head_dim"]
        G = a["num_heads"] // Hkv
        out = torch.empty((x.shape[0], a["num_heads"] * D), dtype=q.dtype, device=q.device)  # [t, Hq*D]
        for g in view.decode_groups:
            kg = kbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * kbuf.shape[2], D)  # [Hkv, S, c, D]
            vg = vbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * kbuf.shape[2], D)
            qg = q[g.rows].view(g.S, Hkv, G, D).transpose(0, 1)  # [Hkv, S, G, D]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask[None, :, None, :],
                                               scale=a["scaling"])  # [Hkv, S, G, D]
            out[g.rows] = o.transpose(0, 1).reshape(g.S, -1)
        for p in view.prefill:
            c = p.start + (p.hi - p.lo)  # context after this chunk
            ks = kbuf[:, p.first:p.first + p.nblocks].reshape(Hkv, -1, D)[:, :c]  # [Hkv, c, D]
            vs = vbuf[:, p.first:p.first + p.nblocks].reshape(Hkv, -1, D)[:, :c]
            out[p.lo:p.hi] = kernels.attend(q[p.lo:p.hi], ks, vs, p.start, a)
        return kernels.linear(out, w["o"], w.get("o_bias"))

    def _gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring one layer's KV blocks for a micro-batch to the compute device, into a buffer
        reused across layers and steps (grown when a micro-batch needs more)."""
        kv = self.kv
        shape = (kv.k.shape[1], blocks.numel(), kv.block_size, kv.k.shape[4])  # [Hkv, nb, bs, D]
        need = shape[0] * shape[1] * shape[2] * shape[3]
        if self._kv_buf is None or self._kv_buf[0].numel() < need:
            size = max(need, int(need * 1.25))
            self._kv_buf = (torch.empty(size, dtype=kv.k.dtype, device="cpu"),
                            torch.empty(size, dtype=kv.k.dtype, device="cpu"))
        hk, hv = self._kv_buf[0][:need].view(shape), self._kv_buf[1][:need].view(shape)
        kv.gather(layer, blocks, hk, hv)
        return hk.to(self.device), hv.to(self.device)

    def close(self) -> None:
        self.store.close()


# -- the per-step bookkeeping, computed once and shared by every layer ---------------------

@dataclass
class _DecodeGroup:
    """Decoding sequences of a micro-batch that span the same number of KV blocks."""

    rows: torch.Tensor  # [S] their rows in the micro-batch
    first: int  # their blocks' offset in the gathered buffer
    S: int
    n: int  # blocks per sequence
    mask: torch.Tensor  # [S, n*bs] True where a key position may be attended


@dataclass
class _PrefillChunk:
    lo: int  # rows lo..hi-1 of the micro-batch
    hi: int
    start: int  # position of row lo
    first: int  # blocks' offset in the gathered buffer
    nblocks: int


@dataclass
class _KVView:
    blocks: torch.Tensor  # [nb] physical blocks to gather, in buffer order
    decode_groups: list[_DecodeGroup]
    prefill: list[_PrefillChunk]


@dataclass
class _MicroBatch:
    r0: int  # rows r0..r1-1 of the step
    r1: int
    items: list[tuple[int, int, int, int]]  # (sid, local row, start position, n) per sequence
    tables: list[list[int]]
    write_blocks: torch.Tensor  # [t] where each row's K/V goes
    write_offsets: torch.Tensor  # [t]
    _views: dict[int | None, _KVView] = field(default_factory=dict)

    def view(self, window: int | None, bs: int) -> _KVView:
        """Which blocks attention reads, per sliding-window size (None = full)."""
        if window not in self._views:
            self._views[window] = self._build_view(window, bs)
        return self._views[window]

    def _build_view(self, window: int | None, bs: int) -> _KVView:
        blocks: list[int] = []
        by_n: dict[int, list[tuple[int, int, int]]] = {}  # n blocks -> (item index, first block, ctx)
        prefill: list[_PrefillChunk] = []
        for idx, (_, row, start, n) in enumerate(self.items):
            ctx = start + n
            table = self.tables[idx]
            if n == 1:
                lo = 0 if window is None else max(0, ctx - window) // bs
                by_n.setdefault(self.blocks_needed(ctx, bs) - lo, []).append((idx, lo, ctx))
            else:
                nb = self.blocks_needed(ctx, bs)
                prefill.append(_PrefillChunk(row, row + n, start, len(blocks), nb))
                blocks.extend(table[:nb])
        groups = []
        for nblk, members in sorted(by_n.items()):
            first = len(blocks)
            kpos = []
            for idx, lo, ctx in members:
                blocks.extend(self.tables[idx][lo:lo + nblk])
                kpos.append((lo * bs, ctx))
            base = torch.tensor([p for p, _ in kpos])[:, None]  # [S, 1]
            ctxs = torch.tensor([c for _, c in kpos])[:, None]  # [S, 1]
            pos = base + torch.arange(nblk * bs)[None, :]  # [S, n*bs]
            mask = pos < ctxs
            if window is not None:
                mask &= pos > ctxs - 1 - window
            rows = torch.tensor([self.items[idx][1] for idx, _, _ in members])
            groups.append(_DecodeGroup(rows, first, len(members), nblk, mask))
        return _KVView(torch.tensor(blocks, dtype=torch.long), groups, prefill)

    @staticmethod
    def blocks_needed(ctx: int, bs: int) -> int:
        return -(-ctx // bs)


@dataclass
class _StepBatch:
    work: list[tuple[Sequence, int]]
    T: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    spans: list[tuple[int, int]]  # each sequence's rows
    blocks: torch.Tensor  # [T] KV block of each row
    offsets: torch.Tensor  # [T] offset in that block
    finishing: list[Sequence]  # sequences whose tokens are all cached after this step
    last_rows: torch.Tensor  # [S'] their last rows (indexes host buffers)
    prefill_tokens: int
    tables: list[list[int]]
    _mbs: list[_MicroBatch] | None = None

    @classmethod
    def build(cls, work: list[tuple[Sequence, int]], kv: PagedKVCache, device: torch.device) -> "_StepBatch":
        ids: list[int] = []
        pos: list[int] = []
        blk: list[int] = []
        off: list[int] = []
        spans: list[tuple[int, int]] = []
        finishing: list[Sequence] = []
        last: list[int] = []
        prefill = 0
        for s, n in work:
            spans.append((len(ids), len(ids) + n))
            ids.extend(s.tokens[s.cached:s.cached + n])
            pos.extend(range(s.cached, s.cached + n))
            bl, of = kv.slots(s.sid, s.cached, n)
            blk.extend(bl)
            off.extend(of)
            if n > 1 or s.cached < s.prompt_len:
                prefill += n
            if s.cached + n == len(s.tokens):
                finishing.append(s)
                last.append(len(ids) - 1)
        return cls(work, len(ids), torch.tensor(ids, dtype=torch.long, device=device),
                   torch.tensor(pos, dtype=torch.long, device=device), spans,
                   torch.tensor(blk, dtype=torch.long), torch.tensor(off, dtype=torch.long), finishing,
                   torch.tensor(last, dtype=torch.long), prefill, [kv.tables[s.sid] for s, _ in work])

    def micro_batches(self, b_a: int, kv: PagedKVCache) -> list[_MicroBatch]:
        """Consecutive groups of at most b_a sequences (cached on first use in a step)."""
        if self._mbs is None:
            mbs = []
            for a in range(0, len(self.work), b_a):
                z = min(len(self.work), a + b_a)
                r0, r1 = self.spans[a][0], self.spans[z - 1][1]
                items = [(s.sid, self.spans[i][0] - r0, s.cached, n)
                         for i, (s, n) in enumerate(self.work[a:z], start=a)]
                mbs.append(_MicroBatch(r0, r1, items, self.tables[a:z], self.blocks[r0:r1], self.offsets[r0:r1]))
            self._mbs = mbs
        return self._mbs
