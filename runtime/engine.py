"""Execute a plan's module schedule over a batch of sequences.

One engine step runs every admitted sequence's pending tokens together: whole prompts of
newly admitted sequences (prefill) and one token of each running sequence (decode),
flattened into T rows. Modules run in plan order over all T rows: attention modules in
micro-batches of b_a sequences, expert modules with each expert over every token routed
to it in chunks of b_e, values crossing modules kept in host buffers. Only the last row of
each sequence reaches the head (final norm, lm_head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moecc_runtime import kernels
from moecc_runtime.kv import SequenceKV
from moecc_runtime.weights import TORCH_DTYPES, WeightStore

TRANSFER_OPS = frozenset({"fetch_weights", "fetch_experts", "kv_load", "kv_store"})


@dataclass
class Sequence:
    """One request in flight: its tokens, its KV cache, where its new rows are this step."""

    sid: int
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    max_new: int
    kv: SequenceKV | None = None
    cached: int = 0  # positions already in the KV cache
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


@dataclass
class StepStats:
    tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    experts_run: int = 0


class Engine:
    def __init__(self, plan: dict[str, Any], model_dir: Path, device: torch.device | str = "cpu",
                 expert_chunk: int | None = None, attn_micro_batch: int | None = None):
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
        self.stats = StepStats()

    # -- KV ---------------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> None:
        i = self.info
        seq.kv = SequenceKV(i["num_layers"], i["num_kv_heads"], i["head_dim"],
                            seq.prompt_len + seq.max_new, self.dtype, self.device)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> torch.Tensor:
        """Run every sequence's uncached tokens; return next-token logits [S, V] (fp32)."""
        ids: list[int] = []
        pos: list[int] = []
        spans: list[tuple[int, int]] = []  # each sequence's rows in the flat T
        for s in seqs:
            new = s.tokens[s.cached:]
            spans.append((len(ids), len(ids) + len(new)))
            ids.extend(new)
            pos.extend(range(s.cached, s.cached + len(new)))
            if len(new) > 1:
                self.stats.prefill_tokens += len(new)
            else:
                self.stats.decode_tokens += len(new)
        self.stats.tokens += len(ids)
        ctx = _StepContext(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(pos, dtype=torch.long, device=self.device),
            seqs=seqs, spans=spans,
            last_rows=torch.tensor([b - 1 for _, b in spans], dtype=torch.long),  # indexes host buffers
        )
        env: dict[str, torch.Tensor] = {"input_ids": ctx.input_ids, "positions": ctx.positions}
        logits = None
        for module in self.schedule:
            kind = module["kind"]
            if kind == "attn":
                for a in range(0, len(seqs), self.b_a):
                    self._run_module(module, env, ctx, seq_range=(a, min(len(seqs), a + self.b_a)))
            else:
                out = self._run_module(module, env, ctx, seq_range=None)
                if kind == "head":
                    logits = out
        for s, (a, b) in zip(seqs, spans):
            s.cached += b - a
        assert logits is not None, "plan has no head module"
        return logits.float()

    def _run_module(self, module: dict, env: dict[str, torch.Tensor], ctx: "_StepContext",
                    seq_range: tuple[int, int] | None) -> torch.Tensor | None:
        """Run one module's ops. seq_range: the attention micro-batch (else all rows; the
        head module reads only each sequence's last row)."""
        if seq_range is not None:
            rows: slice | torch.Tensor = slice(ctx.spans[seq_range[0]][0], ctx.spans[seq_range[1] - 1][1])
        elif module["kind"] == "head":
            rows = ctx.last_rows
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
                    full = torch.empty((ctx.input_ids.shape[0], *x.shape[1:]), dtype=x.dtype, device="cpu")
                    env[op["name"]] = full
                full[rows] = x.to("cpu")
                continue
            last = local[op["name"]] = self._compute(op, inputs, ctx, seq_range)
        return last

    def _w(self, op: dict, local: str) -> torch.Tensor:
        return self.store.get(op["weights"][local])

    def _compute(self, op: dict, x: list[Any], ctx: "_StepContext", seq_range) -> Any:
        kind, a = op["op"], op["attrs"]
        if kind == "embed":
            return torch.nn.functional.embedding(x[0], self._w(op, "weight"))
        if kind == "rope":
            return kernels.rope_table(x[0], self.inv_freq, self.rope_scaling, self.dtype)
        if kind == "rmsnorm":
            return kernels.rmsnorm(x[0], self._w(op, "weight"), a["eps"])
        if kind == "attention":
            return self._attention(op, x[0], x[1], ctx, seq_range)
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
            b = self._w(op, "bias") if "bias" in op["weights"] else None
            return kernels.linear(x[0], self._w(op, "weight"), b)
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

    def _attention(self, op: dict, x: torch.Tensor, rope: torch.Tensor, ctx: "_StepContext",
                   seq_range: tuple[int, int]) -> torch.Tensor:
        a = op["attrs"]
        w = {k: self._w(op, k) for k in op["weights"]}
        q, k, v = kernels.attention_qkv(x, w, a, rope)  # [t, Hq, D], [t, Hkv, D] x2
        layer = a["layer_index"]
        base = ctx.spans[seq_range[0]][0]
        outs = []
        for si in range(*seq_range):
            s = ctx.seqs[si]
            lo, hi = (r - base for r in ctx.spans[si])
            s.kv.write(layer, s.cached, k[lo:hi], v[lo:hi])
            outs.append(kernels.attend(q[lo:hi], s.kv.k[layer], s.kv.v[layer], s.cached, a))
        o = torch.cat(outs, dim=0)  # [t, Hq*D]
        return kernels.linear(o, w["o"], w.get("o_bias"))

    def close(self) -> None:
        self.store.close()


@dataclass
class _StepContext:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seqs: list[Sequence]
    spans: list[tuple[int, int]]
    last_rows: torch.Tensor  # [S]
