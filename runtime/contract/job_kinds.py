"""Job kinds of the planner's step model and of the runtime's measured timeline."""

from __future__ import annotations

COMPUTE_JOB_KINDS: tuple[str, ...] = ("attention", "gemm", "router", "head")
COPY_JOB_KINDS: tuple[str, ...] = ("fetch", "kv_load")
#: op -> its job kind on the measured timeline (ops not named here are "glue", the embedding
#: and rope table "stem")
OP_JOB_KIND: dict[str, str] = {"attention": "attention", "router": "router", "mlp": "gemm", "linear": "gemm",
                               "lm_head": "head", "embed": "stem", "rope": "stem"}
