"""Print the demo's story in a few lines: the plan compiled (batch sizes, memory, predicted
tok/s), the run's measured tok/s, where the dumps and pictures are, and the results.

Usage: python examples/demo_summary.py PLAN STATS RESULTS DUMP_DIR PROMPTS
(`examples/run_demo.sh` calls it after `moecc compile` and `moecc exec --stats`.)
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from moecc.views.explain import explain
from moecc_runtime.plan import load_plan


def _mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _used(parts: dict[str, int]) -> int:
    """Bytes planned: the device's larger phase total (arena + temporaries) where the plan has
    one; else every part of the memory table but its budget (the KV pool counted once)."""
    if "decode_total" in parts:
        return max(int(parts["decode_total"]), int(parts.get("prefill_total") or 0))
    skip = {"budget", "kv_cache"} if "kv_pool" in parts else {"budget"}
    return sum(v for k, v in parts.items() if k not in skip and isinstance(v, (int, float)))


def _asked(prompts_path: Path) -> dict[str, str]:
    """custom_id -> what the request asked: its prompt, or its last chat message."""
    asked = {}
    for line in prompts_path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            asked[r["custom_id"]] = r.get("prompt") or f"(chat) {r['messages'][-1]['content']}"
    return asked


def summary(plan_path: Path, stats_path: Path, results_path: Path, dumps: Path, prompts_path: Path) -> list[str]:
    plan = load_plan(plan_path)
    rep = explain(plan)
    info = plan["model"]["info"]
    dec, pre = rep["batch"]["decode"], rep["batch"]["prefill"]
    dev, host = rep["device_bytes"], rep["host_bytes"]
    stats = json.loads(stats_path.read_text(encoding="utf-8"))
    lines = [
        f"plan     {plan_path}: {rep['model']}, {info['num_layers']} layers; "
        f"B={dec['B']} sequences, decode b_a={dec['b_a']} b_e={dec['b_e']}, prefill b_a={pre['b_a']} b_e={pre['b_e']}",
        f"memory   device {_mib(_used(dev))} planned (budget {_mib(dev.get('budget'))}), "
        f"host {_mib(_used(host))} (budget {_mib(host.get('budget')) if host.get('budget') else 'unset'})",
        f"predict  decode {rep['decode_tokens_per_s']:.0f} tok/s, prefill {rep['prefill_tokens_per_s']:.0f} tok/s "
        f"(bottleneck: decode {rep['bottleneck']['decode']}, prefill {rep['bottleneck']['prefill']})",
        f"measured {stats['completion_tokens']} tokens generated in {stats['seconds']:.2f}s: "
        f"{stats['completion_tokens'] / max(stats['seconds'], 1e-9):.0f} tok/s "
        f"({stats['succeeded']} ok, {stats['failed']} failed)",
        f"dumps    {dumps}/NNN_<pass>.txt after every pass, .onnx (open in Netron) and .svg pictures; "
        f"`moecc explain {plan_path}` says why the plan is what it is",
        f"results  {results_path}:",
    ]
    asked = _asked(prompts_path)
    for line in results_path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        text = " ".join(r["text"].split())
        lines.append(textwrap.shorten(f"  [{r['custom_id']}] {asked.get(r['custom_id'], '')} ▸ {text}", width=160,
                                      placeholder=" ..."))
    return lines


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(summary(*map(Path, argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
