"""``bench_many.py``'s checkpoint and its one measurement: a model of ~92,000 tensors with real
bytes, small enough to load whole.

The checkpoint is DeepSeek-V3 as the coverage table has it (``scripts/vllm_coverage.py``: its
config, and the names, shapes and dtypes its writer stores), every width divided by
``factor`` and the FP8 weight blocks with them (128 x 128 becomes 2 x 2 at 64): every count
stays (61 layers and the MTP layer, 256 routed experts, 128 heads, 91,991 tensors), and every
divisibility the planner checks holds as it does at full size, so the plan is the published
model's, shrunk. Unlike ``bench_scale.py``'s header-only copies, every tensor has data (random
bytes; FP8 weights without NaN patterns), written with ``safetensors`` into the files the
full-size writer would make (the same tensors per file: 139 of them), about 0.3 GB at 64.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time

from .harness import REPO

if REPO not in sys.path:  # devtools: the checkout's development code
    sys.path.append(REPO)
from devtools.coverage import coverage_script as coverage

#: the coverage table's model this benchmark shrinks
MODEL = "deepseek-ai/DeepSeek-V3"
#: the config's widths (divided by the factor); counts (layers, experts, heads) stay
WIDTHS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
)
#: bump when what is written changes, so that a cached copy is written again
VERSION = 1
#: the torch dtype of each safetensors dtype the writer stores
_TORCH = {
    "F8_E4M3": "float8_e4m3fn",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
}


def model(factor: int, layers: int | None = None, experts: int | None = None) -> dict:
    """The coverage table's DeepSeek-V3 with its widths and FP8 blocks divided by ``factor``
    (and, where given, ``layers`` layers of ``experts`` routed experts: a smaller model of
    the same shape, for a smoke run); ``ValueError`` where one does not divide."""
    base = {m["name"]: m for m in coverage().MODELS}[MODEL]
    small = copy.deepcopy(base)
    config = small["config"]
    if layers is not None:
        config.update(num_hidden_layers=layers, first_k_dense_replace=min(3, layers - 1))
    if experts is not None:
        config["n_routed_experts"] = experts
    for key in WIDTHS:
        if config[key] % factor:
            raise ValueError(f"{key}={config[key]} is not a multiple of {factor}")
        config[key] //= factor
    q = config["quantization_config"]
    if any(b % factor for b in q["weight_block_size"]):
        raise ValueError(f"the FP8 blocks {q['weight_block_size']} do not divide by {factor}")
    q["weight_block_size"] = [b // factor for b in q["weight_block_size"]]
    # hidden_size / heads no longer divides (128 heads stay): say the head size, as newer
    # transformers' DeepSeek configs do (its rope part; MLA's heads are sized by nope + rope)
    config["head_dim"] = config["qk_rope_head_dim"]
    small["name"] = f"{MODEL}, widths / {factor}" + (
        ""
        if layers is None and experts is None
        else f", {config['num_hidden_layers']} layers of {config['n_routed_experts']} experts"
    )
    return small


def _files(full: dict) -> list[list[str]]:
    """The tensors of each file the full-size writer makes of ``full`` (``write_checkpoint``:
    at most ``SHARD_BYTES`` of data per file), by name."""
    cov = coverage()
    files: list[list[str]] = [[]]
    held = 0
    for name, shape, dtype, *_ in cov.stored_tensors(full["config"]):
        size = math.prod(shape) * cov.BYTES[dtype]
        if held and held + size > cov.SHARD_BYTES:
            files.append([])
            held = 0
        files[-1].append(name)
        held += size
    return files


def _data(shape: list[int], dtype: str, values, rng):
    """A tensor of ``shape``/``dtype``: the writer's values where it gives some, else random
    (FP8 bytes drawn below 0x78, whose patterns are all numbers)."""
    import numpy as np
    import torch

    if values is not None:
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(shape)
    n = math.prod(shape)
    if dtype == "F8_E4M3":
        return (
            torch.from_numpy(rng.integers(0, 0x78, n, dtype=np.uint8))
            .view(torch.float8_e4m3fn)
            .reshape(shape)
        )
    if dtype in ("F32", "BF16", "F16"):
        return (
            torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
            .to(getattr(torch, _TORCH[dtype]))
            .reshape(shape)
        )
    info = np.iinfo(_TORCH[dtype])
    return torch.from_numpy(
        rng.integers(0, min(info.max, 1 << 15), n, dtype=_TORCH[dtype])
    ).reshape(shape)


def ensure(
    root: str, factor: int = 64, layers: int | None = None, experts: int | None = None, log=print
) -> tuple[str, int]:
    """The checkpoint ``model(factor, layers, experts)`` under ``root`` (written once), and
    its tensor count."""
    import numpy as np
    from safetensors.torch import save_file

    small = model(factor, layers, experts)
    shape = (
        ""
        if layers is None and experts is None
        else f"-l{small['config']['num_hidden_layers']}-e{small['config']['n_routed_experts']}"
    )
    folder = os.path.join(root, f"deepseek-v3-w{factor}{shape}-v{VERSION}")
    done = os.path.join(folder, "tensors.txt")
    if os.path.isfile(done):
        with open(done) as f:
            return folder, int(f.read())
    full = model(1, layers, experts)  # the same tensors at full size: its files
    files = _files(full)
    tensors = {
        name: (shape, dtype, values[0] if values else None)
        for name, shape, dtype, *values in coverage().stored_tensors(small["config"])
    }
    if sum(map(len, files)) != len(tensors):
        raise AssertionError("the full-size and the scaled model store different tensors")
    log(f"writing {small['name']} ({len(tensors)} tensors, {len(files)} files) to {folder}")
    started = time.perf_counter()
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for i, names in enumerate(files, 1):
        file = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        data = {name: _data(*tensors[name], rng) for name in names}
        save_file(data, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update((name, file) for name in names)
        total += sum(t.numel() * t.element_size() for t in data.values())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(small["config"], f, indent=2)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(done, "w") as f:
        f.write(f"{len(weight_map)}\n")
    log(f"written: {total / 1e9:.2f} GB in {time.perf_counter() - started:.0f} s")
    return folder, len(weight_map)


#: the phases of one load, in the order they run
PHASES = ("session_start", "open", "plan", "read_plans", "load")


def _cpu_seconds(pids: list[int]) -> float | None:
    """User and system CPU seconds of processes ``pids`` so far (Linux ``/proc``), or None."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        return total
    except (OSError, ValueError, IndexError):
        return None


def measure(folder: str, workers: int, session_kind: str = "process") -> dict:
    """One load of ``folder`` onto a new session of ``workers`` CPU workers (``process``: a
    ``ProcessSession``; ``thread``: a ``ThreadedSession``), each phase timed:
    ``session_start`` (the session opened), ``open`` (``open_checkpoint``: every header),
    ``plan`` (``resolve_plan``: planned from the config, bound and validated),
    ``read_plans`` (``load_validated`` up to the workers' start: every worker's read plan
    built and sent), ``load`` (the workers loading their pieces: ``LoadStats.seconds``);
    with this process's CPU seconds over the load (``cpu_s``) and the worker processes'
    (``workers_cpu_s``), the pieces kept and the bytes."""
    from shardload import ProcessSession, ThreadedSession, open_checkpoint
    from shardload.frontdoor import resolve_plan
    from shardload.loader import load_validated

    out: dict = {}
    t = time.perf_counter()
    session = (
        ProcessSession(workers, device="cpu")
        if session_kind == "process"
        else ThreadedSession(workers)
    )
    try:
        out["session_start"] = time.perf_counter() - t
        pids = list(getattr(session, "pids", []))
        workers_cpu = _cpu_seconds(pids)
        cpu = time.process_time()
        t = time.perf_counter()
        with open_checkpoint(folder) as ckpt:
            out["open"], t = time.perf_counter() - t, time.perf_counter()
            resolved = resolve_plan(ckpt, workers)
            out["plan"], t = time.perf_counter() - t, time.perf_counter()
            sharded = load_validated(ckpt, resolved.validated, session, progress=False)
            whole = time.perf_counter() - t
        out["load"] = sharded.stats.seconds
        out["read_plans"] = whole - sharded.stats.seconds
        out["cpu_s"] = time.process_time() - cpu
        after = _cpu_seconds(pids)
        out["workers_cpu_s"] = (
            after - workers_cpu if pids and None not in (after, workers_cpu) else None
        )
        out["pieces"] = sum(sharded.stats.tensors_per_worker)
        out["bytes"] = sharded.stats.bytes_total
        del sharded
    finally:
        session.close()
    out["total"] = sum(out[p] for p in PHASES)
    return out
