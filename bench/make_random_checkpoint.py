"""A random-weight bf16 checkpoint of Qwen3-30B-A3B's published shape, written tensor by
tensor without building the model (so 40 GB of it needs a few GB of memory, not 40).

    python bench/make_random_checkpoint.py DIR                  # 24 layers, ~31 GB
    python bench/make_random_checkpoint.py DIR --layers 48      # the full model, ~61 GB
    python bench/make_random_checkpoint.py DIR --headers-only   # same files, sparse: headers only
    python bench/make_random_checkpoint.py DIR --tiny           # 2 layers, 8 experts, hidden 256
    python bench/make_random_checkpoint.py --check              # verify names, shapes, headers

The config is Qwen3-30B-A3B's published config.json (qwen3_moe: hidden 2048, 128 experts of
768, top-8, 32/4 heads of 128, vocab 151936, rope_theta 1e6) except: `num_hidden_layers`
(--layers, default 24 so the checkpoint fits a 64 GB disk with room to spare), the special
token ids (those of the small BPE tokenizer moecc's tests train on moecc/testing/corpus.txt:
<pad>=0, <s>=1) and `eos_token_id: null`, so that random weights never stop a request early
and every request generates exactly its max_tokens (as bench/throughput.py does).

Tensors use the published per-expert layout (`model.layers.N.mlp.experts.E.gate_proj.weight`
...), the names `save_pretrained` writes; values are normal * 0.02 (norm weights 1), seeded.
Shards of at most --shard-gb (4 GB) are written by this file's own safetensors writer, which
produces the same bytes as `safetensors.torch.save_file` (--check compares them) and makes
the layout independent of the safetensors version: the headers and file sizes depend only on
the config and the shard size, never on the values, the machine or the device used for the
random numbers (CUDA when there is one, much faster). So a --headers-only build (sparse files
of the right size whose headers are the real ones) compiles into a moecc plan here that
`moecc exec` accepts against a full build made on another machine: the plan's fingerprint is
config.json's sha256 and the weight files' sizes, and its offsets come from the headers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Qwen3-30B-A3B's published config.json (Qwen/Qwen3-30B-A3B), special token ids aside.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,  # published: 151643 (our tokenizer's <s> is 1)
    "decoder_sparse_step": 1,
    "eos_token_id": None,  # published: 151645; none here, so every request runs to max_tokens
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "pad_token_id": 0,  # published: none (our tokenizer's <pad> is 0)
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEFAULT_LAYERS = 24
#: The --tiny variant: same family and layout, small enough to run on a CPU in seconds.
TINY: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
}
STD = 0.02
SHARD_GB = 4.0
DTYPE = "BF16"
ITEMSIZE = 2


def make_config(layers: int | None = None, tiny: bool = False) -> dict[str, Any]:
    cfg = dict(QWEN3_30B_A3B)
    if tiny:
        cfg.update(TINY)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        cfg["max_window_layers"] = layers
    elif not tiny:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = DEFAULT_LAYERS
    return cfg


def config_bytes(cfg: dict[str, Any]) -> bytes:
    """config.json exactly as written (its sha256 is half of a plan's fingerprint)."""
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()


def _is_moe_layer(cfg: dict[str, Any], i: int) -> bool:
    return (i not in cfg["mlp_only_layers"] and cfg["num_experts"] > 0
            and (i + 1) % cfg["decoder_sparse_step"] == 0)


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in the published per-expert layout, in model order."""
    H, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg["vocab_size"], H))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (H,)),
            (p + "self_attn.q_proj.weight", (q, H)),
            (p + "self_attn.k_proj.weight", (kv, H)),
            (p + "self_attn.v_proj.weight", (kv, H)),
            (p + "self_attn.o_proj.weight", (H, q)),
            (p + "self_attn.q_norm.weight", (hd,)),
            (p + "self_attn.k_norm.weight", (hd,)),
            (p + "post_attention_layernorm.weight", (H,)),
        ]
        if _is_moe_layer(cfg, i):
            inter = cfg["moe_intermediate_size"]
            specs.append((p + "mlp.gate.weight", (cfg["num_experts"], H)))
            for e in range(cfg["num_experts"]):
                pe = f"{p}mlp.experts.{e}."
                specs += [(pe + "gate_proj.weight", (inter, H)), (pe + "up_proj.weight", (inter, H)),
                          (pe + "down_proj.weight", (H, inter))]
        else:
            inter = cfg["intermediate_size"]
            specs += [(p + "mlp.gate_proj.weight", (inter, H)), (p + "mlp.up_proj.weight", (inter, H)),
                      (p + "mlp.down_proj.weight", (H, inter))]
    specs.append(("model.norm.weight", (H,)))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (cfg["vocab_size"], H)))
    return specs


def _nbytes(shape: tuple[int, ...]) -> int:
    n = ITEMSIZE
    for d in shape:
        n *= d
    return n


def shard_layout(cfg: dict[str, Any], shard_bytes: int) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """[(file name, tensors)]: model-order tensors filled greedily into shards of <= shard_bytes."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_specs(cfg):
        n = _nbytes(shape)
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    total = len(shards)
    return [(f"model-{k + 1:05d}-of-{total:05d}.safetensors", s) for k, s in enumerate(shards)]


def shard_header(tensors: list[tuple[str, tuple[int, ...]]]) -> tuple[bytes, list[tuple[str, tuple[int, ...]]], int]:
    """safetensors header bytes (length prefix included), tensors in data order, data length.

    Byte for byte what safetensors' serializer writes for one dtype: tensors sorted by name,
    compact JSON with __metadata__ first, padded with spaces to a multiple of 8."""
    order = sorted(tensors, key=lambda t: t[0].encode())
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in order:
        n = _nbytes(shape)
        head[name] = {"dtype": DTYPE, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    js = json.dumps(head, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js, order, off


def _random_fill(name: str, shape: tuple[int, ...], gen, device):
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    return x.mul_(STD).to(torch.bfloat16).cpu()


def build(out_dir: Path, cfg: dict[str, Any], *, headers_only: bool = False, shard_gb: float = SHARD_GB,
          seed: int = 0, device: str = "auto", log=sys.stderr) -> dict[str, Any]:
    """Write config, generation config, tokenizer, shards and index into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = shard_layout(cfg, int(shard_gb * 1e9))
    total = sum(_nbytes(s) for _, ts in layout for _, s in ts)
    if not headers_only:
        free = shutil.disk_usage(out_dir).free + sum(
            (out_dir / f).stat().st_blocks * 512 for f, _ in layout if (out_dir / f).exists())
        if free < total + 2e9:
            raise SystemExit(f"{out_dir}: {free / 1e9:.1f} GB free, the checkpoint needs {total / 1e9:.1f} GB "
                             f"(+2 GB spare); use fewer --layers")
    _write_side_files(out_dir, cfg, layout)
    gen = dev = None
    if not headers_only:
        import torch

        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        gen = torch.Generator(device=dev)
    t0, done = time.perf_counter(), 0
    for k, (fname, tensors) in enumerate(layout):
        header, order, data_len = shard_header(tensors)
        path = out_dir / fname
        with open(path, "wb") as f:
            f.write(header)
            if headers_only:
                f.truncate(len(header) + data_len)  # sparse: the right size, no data blocks
            else:
                gen.manual_seed(seed * 1_000_003 + k)
                for name, shape in order:
                    t = _random_fill(name, shape, gen, dev)
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                    done += t.numel() * ITEMSIZE
        path.chmod(0o644)
        if not headers_only and log is not None:
            dt = time.perf_counter() - t0
            print(f"  [{k + 1}/{len(layout)}] {fname}: {done / 1e9:.1f} of {total / 1e9:.1f} GB "
                  f"in {dt:.0f} s ({done / 1e9 / max(dt, 1e-9):.2f} GB/s, random numbers on {dev})",
                  file=log, flush=True)
    return {"dir": str(out_dir), "shards": len(layout), "bytes": total, "headers_only": headers_only,
            "seconds": time.perf_counter() - t0, "layers": cfg["num_hidden_layers"]}


def _write_side_files(out: Path, cfg: dict[str, Any], layout) -> None:
    sys.path.insert(0, str(ROOT))
    from moecc.testing.checkpoints import build_tokenizer

    (out / "config.json").write_bytes(config_bytes(cfg))
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "do_sample": False, "pad_token_id": cfg["pad_token_id"]}
    if cfg["eos_token_id"] is not None:
        gen_cfg["eos_token_id"] = cfg["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2, sort_keys=True) + "\n")
    # the tests' byte-level BPE (<pad>=0, <s>=1, </s>=2, 384 tokens): every id it makes is a valid model id
    build_tokenizer(out, model_max_length=cfg["max_position_embeddings"])
    weight_map = {name: fname for fname, ts in layout for name, _ in ts}
    index = {"metadata": {"total_size": sum(_nbytes(s) for _, ts in layout for _, s in ts)},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # a stale single-file or differently sharded build would confuse loaders
    names = {f for f, _ in layout}
    for old in out.glob("model*.safetensors"):
        if old.name not in names:
            old.unlink()


def state(out_dir: Path, cfg: dict[str, Any], shard_gb: float = SHARD_GB) -> str | None:
    """'full' or 'headers' when out_dir already holds this exact checkpoint, else None."""
    try:
        if (out_dir / "config.json").read_bytes() != config_bytes(cfg):
            return None
        sparse = False
        for fname, tensors in shard_layout(cfg, int(shard_gb * 1e9)):
            header, _, data_len = shard_header(tensors)
            p = out_dir / fname
            st = p.stat()
            if st.st_size != len(header) + data_len:
                return None
            with open(p, "rb") as f:
                if f.read(len(header)) != header:
                    return None
            sparse |= st.st_blocks * 512 < 0.5 * st.st_size
        if not (out_dir / "tokenizer.json").is_file():
            return None
        return "headers" if sparse else "full"
    except OSError:
        return None


# -- checks --------------------------------------------------------------------------------

def _hf_config(cfg: dict[str, Any]):
    import transformers

    return transformers.Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in (
        "architectures", "torch_dtype", "transformers_version", "model_type")})


def check(log=sys.stdout) -> int:
    """Names and shapes against transformers, and the writer against safetensors' own."""
    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    failures = 0

    def ok(cond: bool, what: str) -> None:
        nonlocal failures
        failures += not cond
        print(f"  {'ok  ' if cond else 'FAIL'} {what}", file=log, flush=True)

    # 1. the full-size config, one layer, on the meta device: transformers' own parameter names
    cfg1 = make_config(layers=1)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(_hf_config(cfg1))
    sd = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mine = dict(tensor_specs(cfg1))
    E, inter, H = cfg1["num_experts"], cfg1["moe_intermediate_size"], cfg1["hidden_size"]
    plain = {k: s for k, s in sd.items() if ".mlp.experts." not in k}
    mine_plain = {k: s for k, s in mine.items() if ".mlp.experts." not in k}
    ok(plain == mine_plain, f"non-expert tensors match Qwen3MoeForCausalLM's state_dict on meta "
                            f"({len(plain)} tensors; transformers {transformers.__version__})")
    fused = {k: s for k, s in sd.items() if ".mlp.experts." in k}
    if any(k.endswith("gate_up_proj") for k in fused):
        want = {"model.layers.0.mlp.experts.gate_up_proj": (E, 2 * inter, H),
                "model.layers.0.mlp.experts.down_proj": (E, H, inter)}
        ok(fused == want, f"its fused experts {fused} are the per-expert gate/up/down stacked")
    else:
        mine_e = {k: s for k, s in mine.items() if ".mlp.experts." in k}
        ok(fused == mine_e, "per-expert tensors match the module's")
    ok(sum(v.numel() for v in model.state_dict().values()) * ITEMSIZE == sum(_nbytes(s) for s in mine.values()),
       "same parameter bytes")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # 2. the published layout as save_pretrained writes it, for the tiny variant
        tiny = make_config(tiny=True)
        ref = tmp / "ref"
        ref_model = transformers.Qwen3MoeForCausalLM(_hf_config(tiny)).to(torch.bfloat16)
        ref_model.save_pretrained(ref)  # what moecc.testing.checkpoints' per_expert layout writes
        del ref_model
        ref_specs: dict[str, tuple[int, ...]] = {}
        for f in ref.glob("*.safetensors"):
            with safe_open(str(f), "pt") as s:
                for k in s.keys():
                    ref_specs[k] = tuple(s.get_slice(k).get_shape())
        ok(ref_specs == dict(tensor_specs(tiny)), f"tiny variant: names and shapes equal save_pretrained's "
                                                  f"({len(ref_specs)} tensors)")
        # 3. headers-only and full builds: identical headers and sizes; small shards to get several
        full = build(tmp / "full", tiny, shard_gb=0.004, seed=1, device="cpu", log=None)
        build(tmp / "head", tiny, shard_gb=0.004, headers_only=True, log=None)
        files = sorted(p.name for p in (tmp / "full").glob("*.safetensors"))
        ok(files == sorted(p.name for p in (tmp / "head").glob("*.safetensors")) and len(files) == full["shards"] > 1,
           f"same {len(files)} shard files")
        same = True
        for f in files:
            a, b = (tmp / "full" / f).read_bytes(), (tmp / "head" / f).read_bytes()
            n = 8 + struct.unpack("<Q", a[:8])[0]
            same &= len(a) == len(b) and a[:n] == b[:n] and not any(b[n:])
        ok(same, "headers-only build: byte-identical headers, equal file sizes, zeros after")
        for name in ("config.json", "model.safetensors.index.json", "generation_config.json", "tokenizer.json"):
            ok((tmp / "full" / name).read_bytes() == (tmp / "head" / name).read_bytes(), f"{name} identical")
        ok(state(tmp / "full", tiny, 0.004) == "full" and state(tmp / "head", tiny, 0.004) == "headers",
           "reuse check tells a full build from a headers-only one")
        # 4. the writer against safetensors' own: same bytes
        same = True
        for f in files:
            t = load_file(str(tmp / "full" / f))
            save_file(t, str(tmp / "resaved.safetensors"), metadata={"format": "pt"})
            same &= (tmp / "resaved.safetensors").read_bytes() == (tmp / "full" / f).read_bytes()
        ok(same, "every shard is byte-identical to safetensors.torch.save_file of its tensors")
        # 5. transformers loads it with nothing missing or unexpected
        m, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "full"), dtype=torch.bfloat16,
                                                                     output_loading_info=True)
        bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        ok(not bad and type(m).__name__ == "Qwen3MoeForCausalLM", f"AutoModelForCausalLM loads it cleanly {bad or ''}")
        # a determinism check: the same seed on the same device gives the same bytes
        again = build(tmp / "again", tiny, shard_gb=0.004, seed=1, device="cpu", log=None)
        ok(all((tmp / "again" / f).read_bytes() == (tmp / "full" / f).read_bytes() for f in files)
           and again["bytes"] == full["bytes"], "rebuilding with the same seed gives the same bytes")
    print(f"{'all checks passed' if not failures else f'{failures} check(s) failed'}", file=log)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, nargs="?")
    ap.add_argument("--layers", type=int, default=None, help=f"decoder layers (default {DEFAULT_LAYERS}; "
                    "published: 48, ~61 GB; --tiny: 2)")
    ap.add_argument("--tiny", action="store_true", help="2 layers, 8 experts (top-2), hidden 256, vocab 4096")
    ap.add_argument("--headers-only", action="store_true",
                    help="sparse shards holding only the real headers (to compile a plan on a small machine)")
    ap.add_argument("--shard-gb", type=float, default=SHARD_GB)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="where to draw the random numbers (auto: cuda if present)")
    ap.add_argument("--force", action="store_true", help="rewrite even if DIR already holds this checkpoint")
    ap.add_argument("--check", action="store_true", help="verify names/shapes/headers on small builds and exit")
    a = ap.parse_args(argv)
    if a.check:
        return check()
    if a.out_dir is None:
        ap.error("DIR is required (or --check)")
    cfg = make_config(a.layers, a.tiny)
    have = state(a.out_dir, cfg, a.shard_gb)
    if not a.force and (have == "full" or (have == "headers" and a.headers_only)):
        print(f"{a.out_dir}: already holds this checkpoint ({have}); --force rewrites it", file=sys.stderr)
        return 0
    res = build(a.out_dir, cfg, headers_only=a.headers_only, shard_gb=a.shard_gb, seed=a.seed, device=a.device)
    kind = "headers only (sparse files)" if a.headers_only else f"written in {res['seconds']:.0f} s"
    print(f"{a.out_dir}: {cfg['num_hidden_layers']} layers, {res['shards']} shards, "
          f"{res['bytes'] / 1e9:.2f} GB, {kind}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
