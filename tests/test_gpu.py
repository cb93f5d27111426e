"""The GPU tests ``benchmarks/gpu_check.sh`` runs first on a GPU machine (``python -m pytest -m
gpu tests/test_gpu.py``): the example checkpoint at a padded N on CUDA threads and on CUDA worker
processes, ``shardload load --device`` onto CUDA, and a cupy shard function on CUDA workers. Each
CUDA case (marked ``gpu``) has a CPU twin, the same test on the device ``cpu``, which runs here
and proves its logic against the same independent references (numpy slices of the stored
tensors, a CPU load), so that a CUDA case failing there points at CUDA, not at the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import helpers.group_plugins  # noqa: F401  (tests.groups.rounds, here and in the workers)
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers.paths import EXAMPLE, REPO
from safetensors.numpy import load_file

from shardload import ProcessSession, Staging, ThreadedSession, load_sharded

CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

#: the example's query heads (8), KV heads (2) and MLP blocks (16) are not divisible by 3: the
#: planner's plan zero-pads them with shardload.take_units (the plan beside it fits 1, 2, 4, 8)
PADDED_N = 3

STORED = os.path.join(EXAMPLE, "model.safetensors")
#: the bytes of the example's tensors: what the workers of one process read between them when
#: their pieces are staged (a replicated tensor is staged once and copied to the others)
STORED_BYTES = sum(a.nbytes for a in load_file(STORED).values())


def _devices(kind: str, n: int) -> list[str]:
    """One device per worker: the CPU, or the GPUs in turn (one GPU: every worker on cuda:0)."""
    if kind == "cpu":
        return ["cpu"] * n
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(n)]


def _numpy_reference(plan, n: int) -> dict[tuple[str, int], np.ndarray]:
    """{(name, worker): piece} from numpy slices of the stored tensors, for every parameter the
    padded plan replicates or takes units of (all but the GPTQ ``g_idx``, whose pieces are
    renumbered: those are compared with a CPU load only). Zero units are zeros."""
    stored = load_file(STORED)
    want = {}
    for name, param in plan.params.items():
        a = stored[name]
        if not param.steps:
            want.update({(name, i): a for i in range(n)})
            continue
        (step,) = param.steps
        if step.func != "shardload.take_units":
            assert step.func == "shardload.take_g_idx", (name, step.func)
            continue
        dim, unit, *indices = step.extra
        axis, per = dim % a.ndim, len(indices) // n
        for i in range(n):
            parts = [
                np.take(a, range(u * unit, (u + 1) * unit), axis=axis)
                if u >= 0
                else np.zeros_like(np.take(a, range(unit), axis=axis))
                for u in indices[i * per : (i + 1) * per]
            ]
            want[name, i] = np.concatenate(parts, axis=axis)
    return want


def _staging(device: str):
    """CUDA: the default (``None``: staged through pinned buffers). CPU: the same pipeline
    asked for (``Staging()``, a copier thread in the stream's place), so that the CPU twin goes
    the CUDA case's way: staged pieces, replicated tensors shared by a process's threads."""
    return None if device == "cuda" else Staging()


def _cpu_load(n: int):
    """The reference load: CPU threads, the direct path."""
    with ThreadedSession(n) as sess:
        return load_sharded(EXAMPLE, None, sess, progress=False, staging=False)


def _check_staging(rings: list, bytes_read: list[int], cuda: bool, threads: bool, cpu) -> None:
    """Every worker staged exactly what it read, through pinned buffers on CUDA; the threads of
    one process read every stored byte once between them, worker processes each their own."""
    assert len(rings) == len(bytes_read)
    for ring, nread in zip(rings, bytes_read, strict=True):
        assert ring is not None and ring["pinned"] is cuda, rings
        assert ring["buffers"] == 4 and ring["bytes_staged"] == nread > 0, rings
    if threads:  # which thread stages a replicated tensor is a race: only the sum is fixed
        assert sum(bytes_read) == STORED_BYTES
    else:
        assert bytes_read == cpu.stats.bytes_read_per_worker


def _check_padded_example(sharded, devices: list[str], threads: bool) -> None:
    """Every piece of every worker equals the CPU load's and, where numpy can make it, the numpy
    reference; the plan is the padded one; the pieces were staged."""
    n = len(devices)
    assert sharded.devices == [torch.device(d) for d in devices]
    padded = [
        name
        for name, p in sharded.plan.params.items()
        for s in p.steps
        if s.func == "shardload.take_units" and -1 in s.extra[2:]
    ]
    assert len(padded) >= 8, "the load did not use the zero-padded plan"
    want, cpu = _numpy_reference(sharded.plan, n), _cpu_load(n)
    for i in range(n):
        mine = sharded.worker(i)
        assert set(mine) == set(cpu.worker(i)) == set(sharded.names)
        for name, piece in mine.items():
            if threads:  # worker processes' pieces come back as CPU copies
                assert piece.device == torch.device(devices[i]), (name, i)
            host = piece.cpu()
            assert torch.equal(host, cpu.shard(name, i)), (name, i)
            if (name, i) in want:
                assert torch.equal(host, torch.from_numpy(want[name, i])), (name, i)
    # worker 2 holds only zero-padding of the query heads: all zeros, yet a piece of its shape
    q = sharded.shard("model.layers.0.self_attn.q_proj.qweight", 2)
    assert q.shape == (32, 128) and not q.cpu().any()
    assert sharded.stats.bytes_per_worker == cpu.stats.bytes_per_worker
    _check_staging(
        sharded.stats.staging_per_worker,
        sharded.stats.bytes_read_per_worker,
        devices[0] != "cpu",
        threads=threads,
        cpu=cpu,
    )


# ---- 1. the example at a padded N, on threads ----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_the_example_at_a_padded_n_on_threads(device):
    devices = _devices(device, PADDED_N)
    with ThreadedSession(PADDED_N, device=devices) as sess:
        sharded = load_sharded(EXAMPLE, None, sess, progress=False, staging=_staging(device))
    _check_padded_example(sharded, devices, threads=True)


# ---- 2. the same on worker processes -------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_the_example_at_a_padded_n_on_worker_processes(device):
    """Worker processes that initialise CUDA themselves (forked from the fork server, which
    never does): a fork after CUDA's initialisation would fail here, not on threads."""
    devices = _devices(device, PADDED_N)
    with ProcessSession(PADDED_N, device=devices) as sess:
        sharded = load_sharded(EXAMPLE, None, sess, progress=False, staging=_staging(device))
        _check_padded_example(sharded, devices, threads=False)  # fetched while open


# ---- 3. the command line -------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_cli_load_onto_the_device_reports_what_each_worker_holds(device):
    from shardload.cli import cli

    n = 2
    devices = _devices(device, n)  # a list: `--device cuda` is cuda:i, refused past the GPUs
    staging = ["--staging", "on"] if device == "cpu" else []  # CUDA: auto stages (see _staging)
    result = CliRunner().invoke(
        cli,
        ["load", "--shards", str(n), "--device", ",".join(devices), *staging, "--json", EXAMPLE],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    cpu = _cpu_load(n)
    assert report["num_shards"] == n
    assert report["shard_info"].endswith("shard_info.json")  # the plan beside it fits 2
    assert report["bytes_total"] == cpu.stats.bytes_total > 0
    workers = report["workers"]
    assert [w["index"] for w in workers] == list(range(n))
    assert [w["device"] for w in workers] == devices
    assert [w["tensors"] for w in workers] == cpu.stats.tensors_per_worker == [63] * n
    assert [w["bytes"] for w in workers] == cpu.stats.bytes_per_worker
    _check_staging(
        [w["staging"] for w in workers],
        [w["bytes_read"] for w in workers],
        device == "cuda",
        threads=True,
        cpu=cpu,
    )


# ---- 4. a cupy shard function --------------------------------------------------------------------

#: run in a fresh interpreter: importing cupy into this one would break test_loader's check that
#: registering a cupy function does not import it (this module runs first). ``argv[1]``: "cpu"
#: or "cuda". Exit 0: passed; 3: cupy cannot run here (the test skips); else: failed.
CUPY_SCRIPT = textwrap.dedent("""
    import sys

    import numpy as np
    import torch

    from shardload import PlanError, Staging, ThreadedSession, load_sharded, register_shard_func

    seen = []

    def body(input, num_shards, output):  # numpy and cupy alike: each worker a block of columns
        seen.append(type(output).__module__.split(".")[0])
        output[...] = (input * 2).reshape(input.shape[0], num_shards, -1).transpose(1, 0, 2)

    register_shard_func("tests.gpu.cupy_split", body, array="cupy")
    register_shard_func("tests.gpu.numpy_split", body, array="numpy")
    n = 3
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    want = [torch.from_numpy(x[:, i * 4:(i + 1) * 4] * 2) for i in range(n)]

    def plan(func):
        return {"w": [[func, [["num_shards", 8, "12 // num_shards"], "float32"], "num_shards"]]}

    if sys.argv[1] == "cpu":
        with ThreadedSession(n) as sess:
            try:
                load_sharded({"w": x}, plan("tests.gpu.cupy_split"), sess, progress=False)
            except PlanError as exc:
                assert "need CUDA devices" in str(exc) and exc.param == "w", exc
            else:
                raise AssertionError("a cupy function was run on CPU workers")
            assert seen == [] and "cupy" not in sys.modules
            # staged, as CUDA workers are by default: the chain's input through the pipeline
            got = load_sharded({"w": x}, plan("tests.gpu.numpy_split"), sess, progress=False,
                               staging=Staging())
        kind, devices = "numpy", ["cpu"] * n
    else:
        try:
            import cupy
            assert int(cupy.arange(4).sum()) == 6
        except Exception as exc:
            print(f"cupy cannot run here: {type(exc).__name__}: {exc}")
            sys.exit(3)
        devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(n)]
        with ThreadedSession(n, device=devices) as sess:
            got = load_sharded({"w": x}, plan("tests.gpu.cupy_split"), sess, progress=False)
        kind = "cupy"
    assert seen and set(seen) == {kind}, seen
    for i in range(n):
        piece = got.shard("w", i)
        assert piece.device == torch.device(devices[i])
        assert torch.equal(piece.cpu(), want[i]), (i, piece, want[i])
    print("ok")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_a_cupy_shard_function_runs_on_cuda_workers(device):
    """CUDA: the function gets cupy arrays on the device and its pieces equal numpy's. CPU: the
    load is refused before anything is read, and the same function as numpy gives numpy's."""
    if device == "cuda":
        import importlib.util

        if importlib.util.find_spec("cupy") is None:  # not imported here: see CUPY_SCRIPT
            pytest.skip("needs cupy (pip install -e '.[cuda]', or cupy-cuda13x)")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
    }
    run = subprocess.run(
        [sys.executable, "-c", CUPY_SCRIPT, device],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("ok")


# ---- 5. collectives among worker processes that share the GPU ------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_worker_processes_sharing_a_device_reduce_over_their_group(device):
    """More workers than GPUs (the GPU machine has one): their group is gloo, since NCCL refuses
    two ranks on one device; all_reduce, broadcast and barrier work among them."""
    from shardload.sessions.process import group_backend

    devices = _devices(device, 2)
    assert group_backend([torch.device(d) for d in devices]) == "gloo"
    with ProcessSession(2, device=devices) as sess:
        assert sess.call("tests.groups.rounds", 2) == [[[11.0, 0.0], [13.0, 101.0]]] * 2
