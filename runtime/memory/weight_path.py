"""How streamed weights reach the device: the one rule, shared by the runtime (which takes the
path) and the compiler / `moecc explain` (which predict it for a plan).

The paths, fastest first on a CUDA run:
  * "registered-mmap": the checkpoint's read-only mapping is pre-faulted and page-locked in
    place (cuMemHostRegister with the READ_ONLY flag, in pieces); every streamed tensor is
    one DMA from the page cache, no host copy. Locks the streamed weights' pages, which the
    plan keeps in RAM anyway (no extra memory).
  * "pinned-copy": the streamed weights are read once from the files into page-locked host
    memory (the page cache dropped behind the read, so nothing is held twice); every streamed
    tensor is one DMA. The fallback where the mapping cannot be registered (a device without
    host-register-read-only support, a filesystem the driver cannot pin).
  * "staged": weights are memmoved (by several threads) from the pageable mapping into
    pinned staging buffers, then DMA'd: bounded by the host's memmove rate (5-10 GB/s, worse
    on first touch). Where pinning is not allowed or the streamed weights do not fit the
    memory that may be locked.
  * "host-memcpy": no CUDA device: the arena is host memory and a copy is a memmove on the
    copy thread (this is what CPU runs and the test suite do).

Needs: nothing (pure arithmetic). Guarantees: `choose_weight_path` is a pure function of its
arguments, so a plan's prediction and a run's choice agree when given the same figures.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class WeightPath(str, Enum):
    """Where a streamed weight's host->device copy reads from (its value is what reports print)."""

    REGISTERED_MMAP = "registered-mmap"
    PINNED_COPY = "pinned-copy"
    STAGED = "staged"
    HOST_MEMCPY = "host-memcpy"

    def __str__(self) -> str:
        return self.value


#: At most this share of the lockable host memory is page-locked for weights: the kernel, the
#: page cache of everything else and late allocations need the rest.
PIN_SHARE = 0.8

#: What each path costs per streamed byte, in words (for `moecc explain`).
DESCRIPTIONS: dict[WeightPath, str] = {
    WeightPath.REGISTERED_MMAP: "DMA straight from the checkpoint's page cache (mapping page-locked in place)",
    WeightPath.PINNED_COPY: "DMA from a page-locked host copy read once at start-up",
    WeightPath.STAGED: "memmoved into pinned staging buffers, then DMA'd (host memmove rate, ~5-10 GB/s)",
    WeightPath.HOST_MEMCPY: "memmove into the host-memory arena (no CUDA device)",
}


def pin_room(mem_available: int | None, other_host_bytes: int = 0) -> int | None:
    """Host bytes that may be page-locked for streamed weights: what is available now
    (MemAvailable) less what the run still has to hold elsewhere (the KV pool's pages as
    they fill, host buffers). None where the memory is unknown."""
    if mem_available is None:
        return None
    return max(0, int(mem_available) - int(other_host_bytes))


def choose_weight_path(device_kind: str, host_available: int | None, streamed_bytes: int,
                       pinning_allowed: bool = True, *, mapping_registrable: bool = True) -> WeightPath:
    """The path streamed weights take.

    needs: `device_kind` ("cuda", "cpu", ...); `host_available`: bytes that may be locked for
    the weights (`pin_room`; None: unknown, trusted as enough since the plan keeps the
    weights in RAM anyway); `streamed_bytes`: the bytes of every weight that streams (not
    resident on the device); `pinning_allowed`: False when the user or the machine forbids
    page-locking (MOECC_NO_PIN=1, no CUDA host registration); `mapping_registrable`: whether
    the checkpoint's mapping can be registered in place (False after a registration the
    driver refused as unsupported).
    guarantees: a pure function; "host-memcpy" exactly when the device is not CUDA.
    """
    if device_kind != "cuda":
        return WeightPath.HOST_MEMCPY
    if not pinning_allowed or streamed_bytes <= 0:
        return WeightPath.STAGED  # nothing streams: resident weights are copied once, staged
    if host_available is not None and streamed_bytes > PIN_SHARE * host_available:
        return WeightPath.STAGED
    return WeightPath.REGISTERED_MMAP if mapping_registrable else WeightPath.PINNED_COPY


def streamed_keys(plan: dict[str, Any]) -> list[str]:
    """The weights of `plan` that stream through the arena's slots (its device budget keeps
    them off the device): the dense weights of modules whose residency group is not resident,
    and the experts of layers whose expert group is not. Empty without an arena. The runtime
    pins exactly these (memory/streaming.py StreamedWeights)."""
    from moecc_runtime.plan_schema import expert_group

    lay = plan.get("arena")
    if not lay:
        return []
    resident = set(lay["resident"])
    keys: list[str] = []
    for m in plan["schedule"]:
        g = m["residency_group"]  # None: host only (the stem)
        for op in m["ops"]:
            if op["op"] == "experts":
                if expert_group(m["layer"]) not in resident:
                    keys += list(op["weights"].values())
            elif g is not None and g not in resident:
                keys += list(op["weights"].values())
    return list(dict.fromkeys(keys))


def plan_streamed_bytes(plan: dict[str, Any]) -> int:
    """Stored bytes (every part, as the manifest gives them) of `streamed_keys(plan)`."""
    man = plan["weights"]
    return sum(int(e.get("nbytes", 0)) for k in streamed_keys(plan)
               for e in [man[k], *man[k].get("parts", {}).values()])


def other_host_bytes(plan: dict[str, Any]) -> int:
    """Host bytes a run of `plan` holds besides the streamed weights' pages: the KV pool (its
    pages fill as the job runs) and the host buffers (plan["memory"]["host"])."""
    host = (plan.get("memory") or {}).get("host") or {}
    return int(host.get("kv_pool", host.get("kv_cache", 0)) or 0) + int(host.get("buffers", 0) or 0)


def predict_weight_path(plan: dict[str, Any], device_kind: str, mem_available: int | None,
                        pinning_allowed: bool = True) -> WeightPath:
    """The path a run of `plan` on a `device_kind` machine with `mem_available` host bytes
    free (its MemAvailable, or the plan's --host-mem budget; None: unknown) will take: the
    same rule and figures the runtime uses. "pinned-copy" is never predicted: the runtime
    takes it only when the driver refuses to register the mapping."""
    return choose_weight_path(device_kind, pin_room(mem_available, other_host_bytes(plan)),
                              plan_streamed_bytes(plan), pinning_allowed)


__all__ = ["DESCRIPTIONS", "PIN_SHARE", "WeightPath", "choose_weight_path", "other_host_bytes", "pin_room",
           "plan_streamed_bytes", "predict_weight_path", "streamed_keys"]
