"""The compile pipeline, one pass per module (flat and in order, tinygrad-style):

    split_modules        decoder layers -> attention module + expert (or dense MLP) module
    quantize_weights     --quantize: selected weights -> int8/int4 refs into the plan's sidecar
    insert_host_buffers  module boundaries -> hidden states gathered in host buffers
    insert_transfers     weight fetches before each module, KV load/store around attention
    solve_batch_sizes    B, b_a, b_e per phase, slots, prefetch, residency: CP-SAT over a
                         measured performance model (moecc/planner)
    emit_plan            lower to the plain-data plan the runtime reads (moecc/codegen)
"""

from __future__ import annotations

from moecc.ir.pass_infra import Pass


def default_pipeline() -> list[Pass]:
    from moecc.codegen.emit_plan import EmitPlan
    from moecc.passes.solve_batch_sizes import SolveBatchSizes
    from moecc.passes.insert_host_buffers import InsertHostBuffers
    from moecc.passes.insert_transfers import InsertTransfers
    from moecc.passes.quantize_weights import QuantizeWeights
    from moecc.passes.split_modules import SplitModules

    return [
        SplitModules(),  # attention vs expert modules per layer
        QuantizeWeights(),  # --quantize: stored bytes the planner sees (no-op without it)
        InsertHostBuffers(),  # host buffers at module boundaries
        InsertTransfers(),  # weight fetches and KV movement
        SolveBatchSizes(),  # B, b_a, b_e, slots, prefetch, residency (CP-SAT)
        EmitPlan(),  # plain-data plan
    ]


PASS_NAMES = ("split_modules", "quantize_weights", "insert_host_buffers", "insert_transfers", "solve_batch_sizes",
              "emit_plan")
