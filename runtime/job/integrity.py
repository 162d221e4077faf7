"""Every byte of a plan's sidecar (the weights `moecc compile --quantize` wrote beside it)
checked before a job's first step, and the sidecar bound to the values of the checkpoint
tensors it was made from, not only their headers.

The sidecar's header metadata holds `content_sha256` (sha256 of "name\\tsha256(bytes)\\n" per
tensor, in file order) and `source_sha256` (the same over the checkpoint tensors named in
`source_tensors`, sorted); the plan records the header's hash, so both digests are the
plan's (runtime/plan.py checks the header). `verify_sidecar` recomputes both from the files.

Cost, measured on this project's shared 2-core VM (under load from other jobs): sha256 reads
1.1 GB/s on one core and 1.7 GB/s on the two threads used here; the demo model's int8 sidecar
and its sources (2.7 + 10.6 MiB) verify in 60-130 ms (2 ms when the stamp below holds). At
that rate a 30B-A3B model's int4 experts (about 16 GB, from 57 GB of bf16) take about 45 s
from the page cache: small against a job of hours, but paid on every start. So that a job
pays it once, not on every resume, a verified pair leaves a stamp beside the sidecar,
`<sidecar>.verified`: the (device, inode, size, mtime, ctime) of the sidecar and of every
checkpoint file it read. Any write to one of them changes its ctime (which no user
tool can set back), so a stamp that still matches proves the bytes are those verified;
anything else is verified again in full. An unwritable stamp only costs the next run a check.

Guarantees: a sidecar whose bytes, or whose source tensors' bytes, differ from what compile
recorded is refused (PlanError naming the file and the recompile command) before any
result file is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

from moecc_runtime.memory.safetensors_header import TensorLocation, read_header
from moecc_runtime.plan import PlanError, sidecar_path

STAMP_SUFFIX = ".verified"
_CHUNK = 64 << 20  # bytes hashed per read: bounded memory whatever the tensor's size
_THREADS = 2


def digest_lines(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 of "name\\tdigest\\n" lines in the order given (as moecc/quantize/writer.py)."""
    return hashlib.sha256("".join(f"{n}\t{d}\n" for n, d in pairs).encode()).hexdigest()


def read_metadata(path: Path) -> dict[str, str]:
    """A safetensors file's `__metadata__` (its header was validated by read_header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        head = json.loads(f.read(n))
    meta = head.get("__metadata__") or {}
    return {str(k): str(v) for k, v in meta.items()}


def tensor_digest(path: Path, loc: TensorLocation) -> str:
    """sha256 of one tensor's bytes in `path`, read in bounded chunks."""
    h, left = hashlib.sha256(), loc.nbytes
    with open(path, "rb", buffering=0) as f:
        f.seek(loc.offset)
        while left > 0:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                break  # a short file: the digest differs, which is the finding
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def _digests(items: list[tuple[str, Path, TensorLocation]]) -> list[tuple[str, str]]:
    """(name, sha256) of each (name, file, location), hashed on a few threads, in order."""
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        return list(zip((n for n, _, _ in items), pool.map(lambda it: tensor_digest(it[1], it[2]), items)))


def recompile_command(plan: dict[str, Any], mdir: Path, plan_path: str | Path) -> str:
    """The command that makes the plan's sidecar again, from the checkpoint it runs on."""
    q = plan["model"]["fingerprint"]["sidecar"]["quantize"]
    group = f" --quantize-group-size {q.get('group_size')}" if q.get("scheme") == "int4" else ""
    return f"moecc compile {mdir} --quantize {q.get('scheme')}{group} --quantize-scope {q.get('scope')} -o {plan_path}"


def _source_items(names: list[str], mdir: Path, files: Iterable[str]) -> list[tuple[str, Path, TensorLocation]]:
    """Where each source tensor is in the checkpoint (its headers, checked by check_checkpoint)."""
    where: dict[str, tuple[Path, TensorLocation]] = {}
    for f in sorted(files):
        for name, loc in read_header(mdir / f).tensors.items():
            where.setdefault(name, (mdir / f, loc))
    missing = [n for n in names if n not in where]
    if missing:
        raise KeyError(missing[0])
    return [(n, *where[n]) for n in names]


def _stat_key(p: Path) -> list[int]:
    st = os.stat(p)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp(side: Path, header_sha: str, files: list[Path]) -> dict[str, Any]:
    return {"header_sha256": header_sha, "files": {str(p.resolve()): _stat_key(p) for p in [side, *files]}}


def _stamp_holds(side: Path, want: dict[str, Any]) -> bool:
    try:
        have = json.loads((side.with_name(side.name + STAMP_SUFFIX)).read_text())
        return have == want
    except (OSError, ValueError):
        return False


def _write_stamp(side: Path, stamp: dict[str, Any]) -> None:
    target = side.with_name(side.name + STAMP_SUFFIX)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(stamp) + "\n")
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)  # best effort: the next run verifies again


def verify_sidecar(plan: dict[str, Any], mdir: Path, plan_path: str | Path,
                   log: Callable[[str], None] | None = None) -> bool:
    """Needs: check_checkpoint passed (the sidecar's header is the plan's). Does: verifies the
    sidecar's data and its source tensors' data against the digests its header records,
    unless a stamp shows both unchanged since the last full check. Returns True when it
    hashed (False: no sidecar, or the stamp held). Raises PlanError naming the file."""
    want = plan["model"]["fingerprint"].get("sidecar")
    if want is None:
        return False
    side = sidecar_path(plan_path)
    redo = f"recompile with `{recompile_command(plan, mdir, plan_path)}`"
    meta = read_metadata(side)
    if "source_sha256" not in meta or "content_sha256" not in meta:
        raise PlanError(f"{side}: these quantized weights record no digest of the checkpoint tensors they were "
                        f"made from (written by an older moecc), so they cannot be checked against {mdir}; {redo}")
    names = json.loads(meta["source_tensors"])
    files = sorted({p for p in plan["model"]["fingerprint"]["weight_files"]})
    try:
        sources = _source_items(names, mdir, files)
    except KeyError as e:
        raise PlanError(f"{side}: made from checkpoint tensor {e.args[0]}, which {mdir} does not hold; "
                        f"{redo}") from None
    stamp = _stamp(side, want["header_sha256"], sorted({p for _, p, _ in sources}))
    if _stamp_holds(side, stamp):
        return False
    _check_data(side, meta, redo, log)
    if digest_lines(_digests(sources)) != meta["source_sha256"]:
        raise PlanError(f"{side}: made from other weights than {mdir} holds now (the checkpoint's tensor values "
                        f"differ from those it was quantized from, though their headers match: a fine-tune or an "
                        f"edit); {redo}")
    _write_stamp(side, stamp)
    return True


def _check_data(side: Path, meta: dict[str, str], redo: str, log: Callable[[str], None] | None) -> None:
    """The sidecar's every tensor hashed against content_sha256."""
    tensors = sorted(read_header(side).tensors.items(), key=lambda kv: kv[1].offset)
    total = sum(loc.nbytes for _, loc in tensors)
    if log is not None and total > (1 << 30):
        log(f"moecc: verifying {side} ({total / 2**30:.1f} GiB) and the checkpoint tensors it was made from")
    if digest_lines(_digests([(n, side, loc) for n, loc in tensors])) != meta["content_sha256"]:
        raise PlanError(f"{side}: the quantized weights file changed since compile (its bytes differ from the "
                        f"digest its header records); {redo}")
