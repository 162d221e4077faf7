"""moecc as one stage of a Ray Data pipeline (`pip install 'moecc[ray]'`).

    python examples/ray_data_pipeline.py PLAN PROMPTS.jsonl OUT_DIR [--workers 2] [--device cpu]

Reads a JSONL file with a "prompt" column (optional "max_tokens", "custom_id", ...), runs it
through moecc on an actor pool (one actor per device, each with its own engine on the plan),
and writes the rows with their "text", "token_ids", "finish_reason" and "error" columns as
JSON files into OUT_DIR. On a cluster, start Ray first (`ray start ...`) and make the plan's
checkpoint directory visible at the same path on every node.
"""

from __future__ import annotations

import argparse

import ray

from moecc_runtime.job.ray_data import MoeccPredictor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("prompts")
    ap.add_argument("out_dir")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (one GPU per actor on CUDA)")
    ap.add_argument("--batch-size", type=int, default=256)
    a = ap.parse_args()
    ray.init(ignore_reinit_error=True)
    gpus = 1 if a.device == "cuda" else 0
    ds = ray.data.read_json(a.prompts)
    out = ds.map_batches(MoeccPredictor, fn_constructor_kwargs={"plan": a.plan, "device": a.device},
                         concurrency=a.workers, batch_size=a.batch_size, num_gpus=gpus,
                         num_cpus=0 if gpus else 1)
    out.write_json(a.out_dir)
    print(f"wrote {a.out_dir}")


if __name__ == "__main__":
    main()
