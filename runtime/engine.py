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
from moecc_runtime.arena import DeviceArena, Region, align
from moecc_runtime.copy_engine import CopyEngine
from moecc_runtime.kv import PagedKVCache
from moecc_runtime.streaming import Copier, InPlaceWeights, KVStaging, StreamedWeights
from moecc_runtime.timeline import StepTrace
from moecc_runtime.weights import TORCH_DTYPES, WeightStore

TRANSFER_OPS = frozenset({"fetch_weights", "fetch_experts", "kv_load", "kv_store"})
#: op -> its kind on the measured timeline (the planner's job kinds; the rest is "glue")
_TIMELINE_KINDS = {"attention": "attention", "router": "router", "mlp": "gemm", "linear": "gemm",
                   "lm_head": "head", "embed": "stem", "rope": "stem"}
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
    copy_seconds: float = 0.0  # copy engine busy time during the step
    wait_seconds: float = 0.0  # compute blocked on copies
    copy_bytes: int = 0


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
    copy_seconds: float = 0.0  # copy engine busy time (weights and KV into the arena)
    wait_seconds: float = 0.0  # compute blocked waiting for copies
    copy_bytes: int = 0
    arena_bytes: int = 0  # the device arena's size (0: no arena, weights read in place)
    peak_device_bytes: int = 0  # arena bytes used at the peak (+ CUDA temporaries on CUDA)
    arena_usage: dict[str, int] = field(default_factory=dict)  # region -> highest byte used
    records: list[StepRecord] | None = None  # per step, when the engine was asked to keep them
    # with records: the measured timeline of one decode and one prefill step (runtime/timeline.py)
    timeline: dict[str, Any] = field(default_factory=dict)

    @property
    def overlap_efficiency(self) -> float | None:
        """Share of copy time hidden behind compute (None when nothing was copied)."""
        if self.copy_seconds <= 0:
            return None
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)


class Engine:
    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu",
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None,
                 kv_blocks: int | None = None, block_size: int | None = None, record_steps: bool = False):
        self.plan = plan
        self.info = plan["model"]["info"]
        self.device = torch.device(device)
        self.dtype = TORCH_DTYPES[self.info["dtype"]]
        self.store = WeightStore(plan["weights"], model_dir, self.device)
        # (b_a, b_e) per phase: a step that is mostly prompt tokens runs with the plan's prefill
        # sizes, any other with its decode sizes (the arena was sized for both)
        self._phase_sizes = {phase: (int(attn_micro_batch or plan["batch"][phase]["b_a"]),
                                     int(expert_chunk or plan["batch"][phase]["b_e"]))
                             for phase in ("decode", "prefill")}
        self.b_a, self.b_e = self._phase_sizes["decode"]
        self.inv_freq_host = plan["rope"]["inv_freq"].float()
        self.rope_scaling = float(plan["rope"]["attention_scaling"])
        self.schedule = plan["schedule"]
        self._producer = {op["name"]: op["op"] for m in self.schedule for op in m["ops"]}
        # per module: (layer, sliding window) of the next attention module in the schedule
        self._next_attn: list[tuple[int, int | None] | None] = []
        nxt: tuple[int, int | None] | None = None
        for m in reversed(self.schedule):
            self._next_attn.append(nxt)
            for op in m["ops"]:
                if op["op"] == "attention":
                    nxt = (op["attrs"]["layer_index"], op["attrs"].get("sliding_window"))
        self._next_attn.reverse()
        kv_plan = plan["batch"].get("kv", {})
        bs = int(block_size or kv_plan.get("block_size", DEFAULT_BLOCK_SIZE))
        seq_len = int(plan["batch"]["workload"]["seq_len"])
        nb = int(kv_blocks or kv_plan.get("num_blocks") or int(plan["batch"]["decode"]["B"]) * -(-seq_len // bs))
        i = self.info
        mla = i.get("extra", {}).get("mla")
        if mla:  # latent attention caches one "head": the latent and the rope key, no V
            hkv, dk, dv = 1, int(mla["kv_lora_rank"]) + int(mla["qk_rope_head_dim"]), 0
        else:
            hkv, dk, dv = i["num_kv_heads"], i["head_dim"], i["head_dim"]
        self.kv = PagedKVCache(i["num_layers"], hkv, dk, block_size=bs, num_blocks=nb, dtype=self.dtype,
                               device="cpu", v_head_dim=dv)
        self._host_bufs: dict[str, torch.Tensor] = {}  # host buffer storage by value name, reused
        self.stats = EngineStats(records=[] if record_steps else None)
        self._step_no = 0
        self._trace: StepTrace | None = None  # the step being recorded for the timeline, if any
        self._layer: int | None = None  # layer of the module running (for the timeline)
        self.arena: DeviceArena | None = None
        self.copy: CopyEngine | None = None
        self.stage: Region | None = None
        lay = plan.get("arena")
        if lay:
            self._init_arena(lay)
        else:
            self.weights: InPlaceWeights | StreamedWeights = InPlaceWeights(self.store)
            self.kv_staging = KVStaging(self.kv, self.device)

    def _init_arena(self, lay: dict[str, Any]) -> None:
        """Carve the plan's arena: resident weights, dense and expert slots, two KV buffers,
        the staging area for hidden states; start the copy engine."""
        bs = self.kv.block_size
        cap_blocks = max(1, int(lay["kv_buffer_tokens"]) // bs)
        kv_bytes = KVStaging.region_bytes(self.kv, cap_blocks)
        self.arena = DeviceArena(int(lay["bytes"]), self.device)
        self.copy = CopyEngine(self.device)
        copier = Copier(self.device, max(int(lay["dense_slot_bytes"]), int(lay["expert_slot_bytes"]), kv_bytes // 2))
        self.weights = StreamedWeights(self.plan, self.store, self.arena, self.copy, copier)
        self.kv_staging = KVStaging(self.kv, self.device, self.copy, self.arena.region("kv_buffers", kv_bytes),
                                    cap_blocks, copier.staging)
        self.stage = self.arena.region("stage", int(lay["stage_bytes"]))
        self.stats.arena_bytes = self.arena.nbytes

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, work: list[tuple[Sequence, int]], all_rows: bool = False) -> tuple[list[Sequence], torch.Tensor]:
        """Run `n` pending tokens of each (sequence, n) in `work`. Returns the sequences whose
        known tokens are now all cached and their next-token logits [S', V] (fp32); with
        `all_rows`, the logits of every row of the step instead, [T, V] in `work` order
        (scoring text: runtime/perplexity.py).
        Raises KVCacheFull before computing anything if the pool cannot hold the step."""
        t0 = time.perf_counter()
        for s, n in work:
            if not 0 < n <= s.pending:
                raise ValueError(f"sequence {s.sid}: asked to run {n} of {s.pending} pending tokens")
            self.kv.reserve(s.sid, s.cached + n)
        b = _StepBatch.build(work, self.kv)
        if all_rows:
            b.last_rows = torch.arange(b.T)  # every row reaches the head
        env: dict[str, torch.Tensor] = {"input_ids": b.input_ids, "positions": b.positions}
        logits = None
        experts_before = self.stats.experts_run
        copy0 = (self.copy.copy_s, self.copy.wait_s, self.copy.bytes) if self.copy else (0.0, 0.0, 0)
        self._step_no += 1
        phase = "prefill" if 2 * b.prefill_tokens > b.T else "decode"
        self.b_a, self.b_e = self._phase_sizes[phase]
        trace = self._trace = self._trace_for(phase, b, t0)
        if self.copy is not None:
            self.copy.trace = trace
        mbs = b.micro_batches(self.b_a, self.kv_staging.cap_blocks)
        for index, module in enumerate(self.schedule):
            kind = module["kind"]
            self._layer = module.get("layer")
            self.weights.enter(index)
            if kind == "attn":
                self._run_attention_module(index, module, env, b, mbs)
            else:
                out = self._run_module(module, env, b, None)
                if kind == "head":
                    logits = out
        if trace is not None:  # the step's mean context: positions a row attends to, before this step's
            context = sum(s.cached + n / 2 for s, n in work) / max(1, len(work))
        for s, n in work:
            s.cached += n
        assert logits is not None, "plan has no head module"
        if trace is not None and self.copy is not None:
            self.copy.trace = None  # before the clock stops: no recorded copy ends after the step
        seconds = time.perf_counter() - t0
        if trace is not None:
            self._trace = None
            self.stats.timeline[phase] = trace.finish(seconds, len(b.work), b.T, b.prefill_tokens, context,
                                                      len(b.finishing))
        self._account(b, seconds, self.stats.experts_run - experts_before, copy0)
        return b.finishing, logits.float()

    def _trace_for(self, phase: str, b: "_StepBatch", t0: float) -> StepTrace | None:
        """Record this step's timeline? Only with step records on. Each phase keeps the step
        that ranks highest so far: prefill steps by (past the first step, which pays first
        touches, and >= 90% prompt tokens; then the prompt share), decode-only steps by
        (past the first two steps; then sequences: the first step at the largest batch)."""
        if self.stats.records is None:
            return None
        kept = self.stats.timeline.get(phase)
        if phase == "prefill":
            share = b.prefill_tokens / max(1, b.T)
            rank = (self._step_no > 1 and share >= 0.9, share)
            old = (kept["step"] > 1 and kept["prefill_tokens"] >= 0.9 * kept["tokens"],
                   kept["prefill_tokens"] / max(1, kept["tokens"])) if kept else None
        else:
            if b.prefill_tokens:
                return None
            rank = (self._step_no > 2, len(b.work))
            old = (kept["step"] > 2, kept["sequences"]) if kept else None
        return StepTrace(phase, self._step_no, t0) if old is None or rank > old else None

    def _run_attention_module(self, index: int, module: dict, env: dict[str, torch.Tensor], b: "_StepBatch",
                              mbs: list["_MicroBatch"]) -> None:
        """Micro-batch by micro-batch; the next micro-batch's KV (after the last one: the next
        attention layer's first) is gathered while this one computes."""
        attn = next(op for op in module["ops"] if op["op"] == "attention")["attrs"]
        layer, window, bs = attn["layer_index"], attn.get("sliding_window"), self.kv.block_size
        nxt = self._next_attn[index]
        for j, mb in enumerate(mbs):
            view = mb.view(window, bs)
            key = (self._step_no, layer, j)
            kv = self.kv_staging.acquire(key, layer, view.blocks)
            if j + 1 < len(mbs):
                self.kv_staging.submit((self._step_no, layer, j + 1), layer, mbs[j + 1].view(window, bs).blocks)
            self._run_module(module, env, b, mb, kv)
            self.kv_staging.release(key)
        if nxt is not None and mbs:
            nlayer, nwindow = nxt
            self.kv_staging.submit((self._step_no, nlayer, 0), nlayer, mbs[0].view(nwindow, bs).blocks)

    def _account(self, b: "_StepBatch", seconds: float, experts: int, copy0: tuple[float, float, int]) -> None:
        st, use = self.stats, self.kv.usage()
        st.steps += 1
        st.seconds += seconds
        copy_s = wait_s = 0.0
        copy_b = 0
        if self.copy is not None:
            copy_s, wait_s, copy_b = (self.copy.copy_s - copy0[0], self.copy.wait_s - copy0[1],
                                      self.copy.bytes - copy0[2])
            st.copy_seconds += copy_s
            st.wait_seconds += wait_s
            st.copy_bytes += copy_b
        if self.arena is not None:
            st.arena_usage = self.arena.usage()
            st.peak_device_bytes = self.arena.peak_bytes
        if self.device.type == "cuda":
            st.peak_device_bytes = max(st.peak_device_bytes, torch.cuda.max_memory_allocated(self.device))
        st.tokens += b.T
        st.prefill_tokens += b.prefill_tokens
        st.decode_tokens += b.T - b.prefill_tokens
        st.peak_kv_allocated_bytes = max(st.peak_kv_allocated_bytes, use.allocated_bytes)
        st.peak_kv_live_bytes = max(st.peak_kv_live_bytes, use.live_bytes)
        if st.records is not None:
            st.records.append(StepRecord(seconds, len(b.work), b.prefill_tokens, b.T - b.prefill_tokens,
                                         experts, use.blocks_used, use.allocated_bytes, use.live_bytes,
                                         copy_s, wait_s, copy_b))

    def release(self, seq: Sequence) -> None:
        """Free a finished (or preempted) sequence's KV blocks."""
        self.kv.release(seq.sid)

    def _run_module(self, module: dict, env: dict[str, torch.Tensor], b: "_StepBatch",
                    mb: "_MicroBatch | None", kv: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor | None:
        """Run one module's ops over the attention micro-batch `mb` (whose gathered KV is
        `kv`), or over all rows (the head module reads only the finishing sequences' last
        rows). The stem (embedding, rope table) runs on the host; other modules' inputs
        are brought from host buffers to the device (into the arena's staging area)."""
        if mb is not None:
            rows: slice | torch.Tensor = slice(mb.r0, mb.r1)
        elif module["kind"] == "head":
            rows = b.last_rows
        else:
            rows = slice(None)
        host = module["kind"] == "stem"
        local: dict[str, Any] = {}
        staged = 0  # bytes of the staging area used by this module's inputs
        last = None

        def arg(name: str) -> Any:
            nonlocal staged
            if name in local:
                return local[name]
            x = env[name][rows]
            if host:
                return x
            if self.stage is None:
                dst = x.to(self.device)
            else:
                dst = self.stage.view(staged, x.shape, x.dtype, what=f"staged input {name} of {module['module']}")
                staged += align(x.numel() * x.element_size())
                dst.copy_(x)
            local[name] = dst  # brought over once per module run, however many ops read it
            return dst

        trace = self._trace
        for op in module["ops"]:
            kind = op["op"]
            if kind in TRANSFER_OPS:
                continue  # the weights policy and the KV staging did these (see streaming.py)
            t_op = time.perf_counter() if trace is not None else 0.0
            inputs = [arg(i) for i in op["inputs"] if self._producer.get(i) not in TRANSFER_OPS]
            if kind == "host_buffer":
                full = env.get(op["name"])
                x = inputs[0]
                if full is None:  # [T, ...] on the host, filled micro-batch by micro-batch
                    full = env[op["name"]] = self._host_buffer(op["name"], (b.T, *x.shape[1:]), x.dtype)
                full[rows] = x.to("cpu")
                continue
            last = local[op["name"]] = self._compute(op, inputs, mb, kv)
            if trace is not None and kind != "experts":  # experts: one job per expert (StepTrace.experts)
                name = f"L{self._layer}.attn.{mb.index}" if kind == "attention" and mb is not None else \
                    f"{module['module']}.{op['name']}"
                trace.add(name, "compute", _TIMELINE_KINDS.get(kind, "glue"), self._layer, t_op, time.perf_counter())
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
        return self.weights.get(op["weights"][local])

    def _compute(self, op: dict, x: list[Any], mb: "_MicroBatch | None",
                 kv: tuple[torch.Tensor, torch.Tensor] | None) -> Any:
        kind, a = op["op"], op["attrs"]
        if kind == "embed":  # on the host: only the rows used travel
            return F.embedding(x[0], self.store.host(op["weights"]["weight"]))
        if kind == "rope":
            return kernels.rope_table(x[0], self.inv_freq_host, self.rope_scaling, self.dtype)
        if kind == "rmsnorm":
            return kernels.rmsnorm(x[0], self._w(op, "weight"), a["eps"])
        if kind == "attention":
            assert mb is not None and kv is not None, f"attention node {op['name']} outside an attention module"
            return self._attention(op, x[0], x[1], mb, kv)
        if kind == "router":
            return kernels.route(x[0], self._w(op, "weight"), a,
                                 self._w(op, "bias") if "bias" in op["weights"] else None)
        if kind == "experts":
            top_w, top_i = x[1]
            trace, layer = self._trace, self._layer

            def weights(es: list[int]):
                it = self.weights.experts(op, es)
                return it if trace is None else trace.experts(it, layer, es)

            out, used = kernels.experts(x[0], top_w, top_i, weights, a["num_experts"], kernels.expert_mlp(a), self.b_e)
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
    def _attention(self, op: dict, x: torch.Tensor, rope: torch.Tensor, mb: "_MicroBatch",
                   kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """kv: this layer's gathered blocks for the micro-batch, [Hkv, nb, bs, D] and
        [Hkv, nb, bs, Dv], gathered before this micro-batch ran: its new K/V go to the host
        pool and into the buffer. Multi-head attention, or latent attention (MLA: one cached
        "head" holding the latent and the rope key, values read from the latent part)."""
        a = op["attrs"]
        w = {k: self._w(op, k) for k in op["weights"]}
        variant = a.get("variant", "mha")
        if variant == "mla":
            q, k, v, finish = kernels.mla_qkv(x, w, a, rope)  # [t, nh, kl+R], [t, 1, kl+R], [t, 1, 0]
        elif variant == "mha":
            q, k, v = kernels.attention_qkv(x, w, a, rope)  # [t, Hq, D], [t, Hkv, D] x2
            finish = None
        else:
            raise RuntimeError(f"runtime: attention variant {variant!r} (node {op['name']}) is not "
                               f"implemented by this runtime")
        layer = a["layer_index"]
        self.kv.write(layer, mb.write_blocks, mb.write_offsets, k.to("cpu"), v.to("cpu"))  # kv_store: to host
        view = mb.view(a.get("sliding_window"), self.kv.block_size)
        kbuf, vbuf = kv
        nb_idx, off = view.new_blocks.to(kbuf.device), view.new_offsets.to(kbuf.device)
        kbuf[:, nb_idx, off] = k.transpose(0, 1).to(kbuf.dtype)  # [Hkv, t, D]
        if vbuf.shape[-1]:
            vbuf[:, nb_idx, off] = v.transpose(0, 1).to(vbuf.dtype)
        else:  # latent attention: the values are the latent part of the key
            vbuf = kbuf[..., :a["kv_lora_rank"]]
        Hkv, D, Dv = kbuf.shape[0], kbuf.shape[-1], vbuf.shape[-1]
        Hq = q.shape[1]
        sinks = w.get("sinks")  # gpt-oss: one extra softmax logit per query head [Hq]
        G = Hq // Hkv
        out = torch.empty((x.shape[0], Hq * Dv), dtype=q.dtype, device=q.device)  # [t, Hq*Dv]
        for g in view.decode_groups:
            kg = kbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * kbuf.shape[2], D)  # [Hkv, S, c, D]
            vg = vbuf[:, g.first:g.first + g.S * g.n].reshape(Hkv, g.S, g.n * kbuf.shape[2], Dv)
            qg = q[g.rows].view(g.S, Hkv, G, D).transpose(0, 1)  # [Hkv, S, G, D]
            if sinks is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask.to(q.device)[None, :, None, :],
                                                   scale=a["scaling"])  # [Hkv, S, G, Dv]
            else:  # [S, Hkv, G, 1, D] queries over [S, Hkv, 1, c, D] keys
                o = kernels.sink_attention(qg.transpose(0, 1)[:, :, :, None], kg.transpose(0, 1)[:, :, None],
                                           vg.transpose(0, 1)[:, :, None], g.mask.to(q.device)[:, None, None, None, :],
                                           a["scaling"], sinks)[:, :, :, 0].transpose(0, 1)
            out[g.rows.to(q.device)] = o.transpose(0, 1).reshape(g.S, -1)
        for p in view.prefill:
            c = p.start + (p.hi - p.lo)  # context after this chunk
            ks = kbuf[:, p.first:p.first + p.nblocks].reshape(Hkv, -1, D)[:, :c]  # [Hkv, c, D]
            vs = vbuf[:, p.first:p.first + p.nblocks].reshape(Hkv, -1, Dv)[:, :c]
            out[p.lo:p.hi] = kernels.attend(q[p.lo:p.hi], ks, vs, p.start, a, sinks)
        if finish is not None:
            return finish(out)
        return kernels.linear(out, w["o"], w.get("o_bias"))

    def close(self) -> None:
        try:
            self.weights.close()
        finally:
            if self.copy is not None:
                self.copy.close()
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
    new_blocks: torch.Tensor  # [t] where each row's new K/V lies in the gathered buffer: block
    new_offsets: torch.Tensor  # [t] and offset in it


@dataclass
class _MicroBatch:
    r0: int  # rows r0..r1-1 of the step
    r1: int
    items: list[tuple[int, int, int, int]]  # (sid, local row, start position, n) per sequence
    tables: list[list[int]]
    write_blocks: torch.Tensor  # [t] where each row's K/V goes
    write_offsets: torch.Tensor  # [t]
    index: int = 0  # which micro-batch of the step
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
        t = self.r1 - self.r0
        new_b, new_o = [0] * t, [0] * t
        for idx, (_, row, start, n) in enumerate(self.items):
            ctx = start + n
            table = self.tables[idx]
            if n == 1:
                lo = 0 if window is None else max(0, ctx - window) // bs
                by_n.setdefault(self.blocks_needed(ctx, bs) - lo, []).append((idx, lo, ctx))
            else:
                nb = self.blocks_needed(ctx, bs)
                prefill.append(_PrefillChunk(row, row + n, start, len(blocks), nb))
                for i in range(n):
                    new_b[row + i], new_o[row + i] = len(blocks) + (start + i) // bs, (start + i) % bs
                blocks.extend(table[:nb])
        groups = []
        for nblk, members in sorted(by_n.items()):
            first = len(blocks)
            kpos = []
            for idx, lo, ctx in members:
                row = self.items[idx][1]
                new_b[row], new_o[row] = len(blocks) + (ctx - 1) // bs - lo, (ctx - 1) % bs
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
        return _KVView(torch.tensor(blocks, dtype=torch.long), groups, prefill,
                       torch.tensor(new_b, dtype=torch.long), torch.tensor(new_o, dtype=torch.long))

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
    block_size: int

    @classmethod
    def build(cls, work: list[tuple[Sequence, int]], kv: PagedKVCache) -> "_StepBatch":
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
        return cls(work, len(ids), torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), spans,
                   torch.tensor(blk, dtype=torch.long), torch.tensor(off, dtype=torch.long), finishing,
                   torch.tensor(last, dtype=torch.long), prefill, [kv.tables[s.sid] for s, _ in work],
                   kv.block_size)

    def micro_batches(self, b_a: int, cap_blocks: int | None = None) -> list[_MicroBatch]:
        """Consecutive groups of at most b_a sequences whose KV (full context) fits one KV
        buffer of `cap_blocks` blocks (None: no limit)."""
        bs = self.block_size
        cuts, a = [], 0
        while a < len(self.work):
            z, used = a, 0
            while z < len(self.work) and z - a < b_a:
                s, n = self.work[z]
                need = -(-(s.cached + n) // bs)
                if cap_blocks is not None and used + need > cap_blocks:
                    if z == a:
                        raise ValueError(f"sequence {s.sid} needs {need} KV blocks but one device KV buffer "
                                         f"holds {cap_blocks}; the plan's arena is too small for it")
                    break
                used += need
                z += 1
            cuts.append((a, z))
            a = z
        mbs = []
        for j, (a, z) in enumerate(cuts):
            r0, r1 = self.spans[a][0], self.spans[z - 1][1]
            items = [(s.sid, self.spans[i][0] - r0, s.cached, n) for i, (s, n) in enumerate(self.work[a:z], start=a)]
            mbs.append(_MicroBatch(r0, r1, items, self.tables[a:z], self.blocks[r0:r1], self.offsets[r0:r1], j))
        return mbs
