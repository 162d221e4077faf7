"""The contract: every rule the compiler and the runtime both compute, stated once, here.

The compiler imports these modules (and plan I/O: plan_schema, plan); the runtime imports
them too; neither restates them. One file per rule:

  blocks.py        KV block math: the planner's block size, blocks for n tokens, per sequence
  prefix.py        the shared-prefix walk: how full KV blocks are keyed and matched
  placement.py     arena alignment and the bytes a weight takes in a device slot
  dtypes.py        dtype names, their sizes, their torch dtypes, the compute dtypes
  formats.py       stored-format constants both sides size by (the MXFP4 group)
  residency.py     the residency group of a module's weights
  speculation.py   when experts are fetched before the router chose them
  kv_geometry.py   what a layer caches per token, and the plan's pool geometry
  plan_types.py    the plan typed (PlanView): what the engine, worker, streaming and KV code read
  model_info.py    the config facts a plan carries (model.info), as one dataclass
  job_kinds.py     job kinds of the planner's step model and the runtime's timeline

Only the standard library and torch; nothing here imports the rest of the runtime.
"""
