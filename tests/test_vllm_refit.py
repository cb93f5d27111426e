"""Refits of a running vLLM engine through vLLM's own weight-transfer API, with the backend
``shardload`` (``shardload/vllm/refit.py``): each ``update_weights`` names a checkpoint.

The engine tests start one engine (vLLM's CPU build, ``SHARDLOAD_VLLM_PYTHON``) on the second
checkpoint (``*_seed1``), which gives the reference: a fresh engine on it, loaded by vLLM's own
loader (or shardload's, where the model is padded). It then refits to the first checkpoint and
back to the second; after that refit the tokens, the top-5 log-probabilities and every
parameter (bitwise) must be the fresh engine's. The refits that must be refused (a tensor
missing, another shape, a file still being written, an object replaced while read) come
first, each leaving the engine's answers as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import vllm_models
from helpers.vllm_checks import refit_there_and_back, run_engine
from helpers.vllm_engine import int4_kernel_missing
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardload.vllm.refit_info import RefitError, RefitInit, parse_init, parse_update
from shardload.vllm.signature import Signature

# -- what a refit is asked (no engine) --------------------------------------------------------


def test_update_info_names_a_checkpoint_or_fills_the_template_with_the_step():
    init = parse_init({"checkpoint": "s3://run/step-{step}/", "timeout": 30})
    assert init.timeout == 30
    assert parse_update({"step": 7}, init).checkpoint == "s3://run/step-7/"
    assert parse_update({"step": "final-1"}, init).step == "final-1"
    padded = parse_init({"checkpoint": "/ckpt/global_step_{step:06d}"})
    assert parse_update({"step": 40}, padded).checkpoint == "/ckpt/global_step_000040"
    assert parse_update({"checkpoint": "gs://b/x/"}, RefitInit()).checkpoint == "gs://b/x/"


@pytest.mark.parametrize(
    "init, update, says",
    [
        ({}, {}, "update_info names the checkpoint to take"),
        ({}, {"checkpoint": "a", "step": 1}, "update_info names the checkpoint to take"),
        ({}, {"step": 1}, "gave no checkpoint template"),
        ({"checkpoint": "x/{step}"}, {"step": -1}, "step must be"),
        ({"checkpoint": "x/{step}"}, {"step": "../up"}, "step must be"),
        ({"checkpoint": "x/{step}"}, {"step": True}, "step must be"),
        ({"checkpoint": "x/{step:04d}"}, {"step": "a"}, "is not a number"),
        ({}, {"checkpoint": ""}, "must be a path or URL"),
        ({}, {"checkpoint": "a", "plan": 3}, "plan must be a path"),
        ({}, {"checkpoint": "a", "stpe": 1}, "has no 'stpe'; it takes checkpoint"),
        ({}, ["a"], "update_info is a dict"),
    ],
)
def test_update_info_refused_naming_what_is_wrong(init, update, says):
    with pytest.raises(RefitError, match=says):
        parse_update(update, parse_init(init))


@pytest.mark.parametrize(
    "init, says",
    [
        ({"checkpoint": "s3://run/latest/"}, "has no {step}"),
        ({"verify": True}, "has no 'verify'; it takes checkpoint"),
        ({"timeout": 0}, "timeout must be a number of seconds above 0"),
        ({"staging": "yes"}, "staging must be"),
    ],
)
def test_init_info_refused_naming_what_is_wrong(init, says):
    with pytest.raises(RefitError, match=says):
        parse_init(init)


def test_a_signature_names_each_tensor_that_differs():
    served = Signature(
        {
            "a": ("bfloat16", (4, 2)),
            "b": ("int32", (8,)),
            "c": ("bfloat16", (2,)),
            "d": ("bfloat16", (1,)),
            "e": ("float16", (3,)),
        },
        "step-1",
    )
    new = Signature(
        {
            "a": ("bfloat16", (4, 3)),  # another shape
            "b": ("float32", (8,)),  # a packed tensor read as floats
            "d": ("bfloat16", (1,)),
            "e": ("float32", (3,)),  # floats vLLM casts, as on a first load
            "z": ("bfloat16", (1,)),  # not the engine's
        },
        "step-2",
    )
    assert new.differences(served) == [
        "a: shape [4, 3], the engine serves [4, 2]",
        "b: dtype float32, the engine serves int32",
        "c: missing",
        "z: not a tensor the engine serves",
    ]
    line = new.describe_differences(served)
    assert line == (
        "4 tensor(s) differ from step-1, which the engine serves: a: shape [4, 3], the engine "
        "serves [4, 2]; b: dtype float32, the engine serves int32; c: missing and 1 more"
    )
    assert served.describe_differences(served) is None


# -- in a running engine --------------------------------------------------------------------------

#: the quantized formats refitted (each has a second checkpoint, ``*_seed1``)
QUANTIZED = ["llama_gptq", "llama_awq", "llama_w8a8", "llama_w4a16"]

#: the tensor the refused checkpoints lack or reshape
TENSOR = "model.layers.1.mlp.up_proj.weight"


def _rewritten(src: Path, dst: Path, change) -> str:
    """A copy of checkpoint ``src`` at ``dst`` with its tensors rewritten by ``change``
    (``{name: tensor}`` in, out), read and written with safetensors itself."""
    shutil.copytree(src, dst)
    f = str(dst / "model.safetensors")
    with safe_open(f, "pt") as fh:
        metadata = fh.metadata()
    save_file(change(load_file(f)), f, metadata=metadata)
    return str(dst)


def _truncated(src: Path, dst: Path) -> str:
    """A copy of ``src`` whose weights file stops halfway, as one still being written."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    return str(dst)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_refit_at_tp2_is_a_fresh_engine_and_a_refused_one_changes_nothing(tmp_path, monkeypatch):
    """TP=2, bf16: from a local folder and from the S3 emulator (each rank fetching only its
    read plan's bytes); seven refits refused on every rank, each in one line (an init_info
    refused, then six checkpoints); and one whose vLLM loader fails midway (injected by
    ``devtools.vllm_ext``), which leaves the layers it did not reach as they were."""
    from helpers import objectservers

    first, second = vllm_models.path("llama_bf16"), vllm_models.path("llama_bf16_seed1")
    missing = _rewritten(
        first, tmp_path / "missing", lambda t: {k: v for k, v in t.items() if k != TENSOR}
    )
    reshaped = _rewritten(
        first, tmp_path / "reshaped", lambda t: {**t, TENSOR: t[TENSOR][:256].clone()}
    )
    # the same bytes, stored as int16: not a float vLLM would cast
    retyped = _rewritten(
        first, tmp_path / "retyped", lambda t: {**t, TENSOR: t[TENSOR].view(torch.int16)}
    )
    writing = _truncated(first, tmp_path / "writing")
    with objectservers.make_server("s3") as server:  # skips without the emulator
        server.make_bucket("run")
        for step, folder in (("1", first), ("2", second), ("replaced", first)):
            for f in folder.iterdir():
                if f.is_file():
                    server.put("run", f"step-{step}/{f.name}", f.read_bytes())
        weights = (first / "model.safetensors").read_bytes()
        header = 8 + int.from_bytes(weights[:8], "little")
        # the object is replaced by another once the ranks have its header, at the first read
        # of its data: their reads name the ETag they listed, and the refit fails on them
        replaced = server.inject(
            "delay",
            key="step-replaced/model.safetensors",
            from_byte=header,
            before=lambda: server.put(
                "run", "step-replaced/model.safetensors", weights[:-4] + b"\0\0\0\1"
            ),
        )
        objectservers.use_env(monkeypatch, server.env())
        steps = [
            {"init_info": {"checkpont": "run/{step}"}, "update_info": {"step": 1}},
            {"update_info": {"checkpoint": missing}},
            {"update_info": {"checkpoint": reshaped}},
            {"update_info": {"checkpoint": retyped}},
            {"update_info": {"checkpoint": writing}},
            {"update_info": {"checkpoint": str(tmp_path / "not-written-yet")}},
            {
                "init_info": {"checkpoint": server.url("run", "step-{step}/")},
                "update_info": {"step": "replaced"},
            },
            # past the checks, vLLM's own load_weights fails after the first weight
            {"fail_after": 1, "update_info": {"checkpoint": str(first)}},
            {"update_info": {"checkpoint": str(first)}},  # local
            # every parameter poisoned first: one the refit does not write shows in its digest
            {"poison": True, "update_info": {"checkpoint": str(second)}},
            {"update_info": {"step": 1}},  # S3, through the template
            {"poison": True, "update_info": {"step": 2}},
        ]
        report, stats, log = run_engine(
            str(second),
            2,
            "--digests",
            "--refits",
            json.dumps(steps),
            env={"SHARDLOAD_OBJECT_MAX_GAP_KB": "0"},  # no gap read through: bytes as planned
        )
        sent = server.bytes_sent("step-2/model.safetensors")
    assert "refits" in report, log[-6000:]
    fresh, digests = report["outputs"], report["digests"]
    refused, midway = report["refits"][:7], report["refits"][7]
    local1, local2, s3_1, s3_2 = report["refits"][8:]
    says = [
        "init_info has no 'checkpont'; it takes checkpoint",
        f"{TENSOR}: missing",
        f"{TENSOR}: shape [256, 256], the engine serves [512, 256]",
        f"{TENSOR}: dtype int16, the engine serves bfloat16",
        "truncated",
        "not-written-yet: no such file or folder",
        "changed while loading",
    ]
    for i, (done, what) in enumerate(zip(refused, says, strict=True)):
        error = done["error"]
        assert error is not None and what in error, (what, error)
        assert "\n" not in error, error
        assert i == 0 or "refused, the engine keeps its weights" in error, error
        assert done["outputs"] == fresh and done["digests"] == digests
    assert replaced.hits == 1
    # the layer of the one weight vLLM took is new, every other parameter as it was (none
    # left on vLLM's meta device): the engine still generates
    error = midway["error"]
    assert error is not None and "failed in vLLM's load_weights" in error, error
    assert "injected failure after 1 weight(s)" in error and "\n" not in error, error
    with safe_open(str(first / "model.safetensors"), "pt") as f:
        taken = next(iter(f.keys()))  # the first weight in storage order, the one handed
    for before, after in zip(digests, midway["digests"], strict=True):
        assert {name for name in before if before[name] != after[name]} == {taken}
    assert all(len(o["tokens"]) == 8 for o in midway["outputs"])
    # the first checkpoint's weights are other weights; the second's, a fresh engine's
    for one in (local1, s3_1):
        assert one["error"] is None, one["error"]
        assert one["digests"] != digests
    assert local1["outputs"] == s3_1["outputs"] != fresh
    for two in (local2, s3_2):
        assert two["error"] is None, two["error"]
        assert two["outputs"] == fresh  # tokens and top-5 logprobs, exactly
        assert two["digests"] == digests  # every parameter, bitwise
    # each rank's statistics line: one a refit that took its weights, by step
    refits = [s for s in stats if s.get("refit")]
    assert len(refits) == 2 * 4
    by_step = {s["step"]: [] for s in refits}
    for s in refits:
        by_step[s["step"]].append(s)
        assert s["bytes_read"] == s["bytes_kept"] > 0 and s["bytes_read_in_place"] == 0
        assert s["seconds"] >= s["apply_seconds"] > 0
    two = sorted(by_step[2], key=lambda s: s["rank"])
    assert [s["rank"] for s in two] == [0, 1]
    assert two[0]["checkpoint"] == server.url("run", "step-2/")
    # from S3, what the ranks read is their read plans' bytes and the header each fetched
    kept = sum(s["bytes_kept"] for s in two)
    assert kept <= sent <= kept + 2 * header


@pytest.mark.slow
@pytest.mark.vllm
def test_a_refit_at_a_padded_tp_is_the_padded_fresh_engine():
    """TP=2 for SmolLM2's 9 query and 3 KV heads: vLLM refuses it, shardload pads them to 12
    and 4 (its ``--hf-overrides``), and the refit reads into the same padded layout."""
    from shardload.vllm import vllm_overrides

    first, second = vllm_models.path("llama9_bf16"), vllm_models.path("llama9_bf16_seed1")
    overrides = vllm_overrides(str(second), 2)
    assert overrides == {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
    report, refits, back = refit_there_and_back(
        str(first),
        str(second),
        2,
        "--load-format",
        "shardload",
        "--hf-overrides",
        json.dumps(overrides),
    )
    assert back["outputs"] == report["outputs"]
    assert all(s["padded_tensors"] > 0 for s in refits)


#: W8A8_RELOAD: vLLM's CPU int8 kernel (oneDNN) keeps, outside the layer's parameters, a
#: handle that points at the weight scales of the layer it processed; vLLM's layerwise reload
#: processes a temporary copy of the layer, copies its parameters back and frees the copy, so
#: the handle points at freed memory. Any in-place reload, vLLM's own included, then generates
#: NaN logprobs with every parameter bitwise right (the W8A8 case shows both in one engine).


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize(
    "name, tp",
    [
        # TP=1 by default: what is the format's own is vLLM's processing of each layer, which a
        # refit runs again; the ranks' reads of each format at TP=2 are the first load's
        # (test_vllm.py) and the refit's TP=2 the bf16 test's above
        *((name, 1) for name in QUANTIZED),
        *(pytest.param(name, 2, marks=pytest.mark.extended) for name in QUANTIZED),
    ],
)
def test_a_quantized_refit_is_a_fresh_engine_loaded_by_vllms_own_loader(name, tp):
    """vLLM repacks and processes each layer as on a first load. Where this CPU has no
    int4 kernel (no AVX-512) the int4 formats are compared bitwise, nothing generated: vLLM's
    own loader could not generate either. W8A8: see ``W8A8_RELOAD``."""
    first, second = vllm_models.path(name), vllm_models.path(f"{name}_seed1")
    tokens = ("--tokens", "0") if name != "llama_w8a8" and int4_kernel_missing() else ()
    default = ("--compare-default",) if name == "llama_w8a8" else ()
    report, _, back = refit_there_and_back(str(first), str(second), tp, *tokens, *default)
    if name != "llama_w8a8":
        assert back["outputs"] == report["outputs"]
        return
    # W8A8_RELOAD: vLLM's own in-place reload, in the same engine, loads every parameter
    # bitwise and then generates what the refit generates (NaN logprobs, so tokens compared)
    assert report["default_digests"] == report["digests"]
    theirs = [o["tokens"] for o in report["default_outputs"]]
    assert [o["tokens"] for o in back["outputs"]] == theirs


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.extended
def test_refits_through_the_api_server_and_a_refused_one_in_between(tmp_path):
    """vLLM's OpenAI server (its RL routes, under ``VLLM_SERVER_DEV_MODE=1``), TP=2, as an RL
    framework drives it over HTTP: refit, a refused refit, refit back; the completions are the
    fresh server's again, and the refused one is a 500 with the one-line reason."""
    import os
    import signal
    import subprocess
    import time
    import urllib.error
    import urllib.request

    from helpers.paths import REPO
    from helpers.subprocesses import subprocess_env
    from helpers.vllm_engine import vllm_python

    from devtools.objectservers import free_port

    first, second = vllm_models.path("llama_bf16"), vllm_models.path("llama_bf16_seed1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "wb")  # closed below, with the server
    server = subprocess.Popen(
        [
            vllm_python(),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(second),
            "-tp",
            "2",
            "--port",
            str(port),
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--skip-tokenizer-init",
            "--weight-transfer-config",
            json.dumps({"backend": "shardload"}),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=subprocess_env(
            VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1"
        ),
        start_new_session=True,  # its engine and workers stopped with it, as a group
    )

    def post(route: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            url + route, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def complete() -> list:
        status, answer = post(
            "/v1/completions",
            {
                "model": str(second),
                "prompt": [1, 5, 9, 13, 200, 7],
                "max_tokens": 6,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert status == 200, answer
        return answer["choices"][0]["token_ids"]

    def refit(checkpoint: str) -> tuple[int, dict]:
        assert post("/start_weight_update")[0] == 200
        status, answer = post("/update_weights", {"update_info": {"checkpoint": checkpoint}})
        if status == 200:
            assert post("/finish_weight_update", {"weight_version": checkpoint})[0] == 200
            assert post("/reset_prefix_cache")[0] == 200
        return status, answer

    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except OSError:
                time.sleep(2)
        fresh = complete()
        assert refit(str(first))[0] == 200
        other = complete()
        status, answer = refit(str(tmp_path / "not-written-yet"))
        message = answer["error"]["message"]
        assert status == 500 and "refused, the engine keeps its weights" in message, answer
        assert complete() == other
        assert refit(str(second))[0] == 200
        assert complete() == fresh != other
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
