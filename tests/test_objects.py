"""Checkpoints in object storage (``s3://``, ``gs://``, ``az://``), against real servers on
127.0.0.1 (moto, fake-gcs-server and Azurite, each behind the counting, fault-injecting proxy of
``helpers/objectservers.py``): every worker's pieces equal the local load's, the bytes the server
sends are what the workers keep (counted at the server), and the failures users meet are one
clear line, on every scheme.

What proves that ``gs://`` and ``az://`` work wherever ``s3://`` goes runs on all three
(``@per_scheme``): loads on threads and on worker processes, the CLI, ``run`` and
``load_tp_model``, a plan, and every failure. A test whose subject is not the scheme (formats,
hostile headers, the corpus, the real model) runs on one (``@on``), the schemes taking turns.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("obstore")

from helpers import objectservers
from helpers.objectservers import SCHEME_PARAMS, SCHEMES, scheme_params
from helpers.paths import EXAMPLE, REPO
from helpers.subprocesses import subprocess_env
from safetensors.numpy import load_file, save_file

from shardload import (
    FormatError,
    PlanError,
    ProcessSession,
    StorageError,
    ThreadedSession,
    load_sharded,
    open_checkpoint,
)
from shardload.sources.urls import SCHEMES as URL_SCHEMES

BUCKET = "models"  # a valid bucket (S3, GCS) and container (Azure) name
per_scheme = pytest.mark.parametrize("scheme", SCHEME_PARAMS)


def on(scheme: str):
    """A test that is not about the scheme, on one of them."""
    return pytest.mark.parametrize("scheme", scheme_params(scheme))


#: what each service calls a bucket, and the variable its credentials hint names
WORD = {"s3": "bucket", "gs": "bucket", "az": "container"}
CREDENTIAL_VARIABLE = {
    "s3": "AWS_ACCESS_KEY_ID",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
    "az": "AZURE_STORAGE_ACCOUNT_KEY",
}
#: the secrets the tests sign with, per scheme (GCS: none, OAuth is off)
SECRETS = {
    "s3": (objectservers.ACCESS_KEY_ID, objectservers.SECRET_ACCESS_KEY),
    "gs": (),
    "az": (objectservers.AZURITE_KEY, objectservers.AZURITE_KEY[:16]),
}


@pytest.fixture(scope="module")
def servers():
    """The module's servers, one per scheme, each started (its bucket made) when a test first
    asks for it and stopped when the module ends."""

    def setup(server: objectservers.ObjectServer) -> None:
        server.make_bucket(BUCKET)
        server.uploaded = set()

    yield from objectservers.servers_on_demand(setup)


@pytest.fixture
def scheme():
    """The scheme of a test that is parametrized by none (``per_scheme`` and ``on`` set it)."""
    return "s3"


@pytest.fixture
def server(servers, scheme, monkeypatch):
    """The scheme's server; this process (and the workers it starts) pointed at it, and a fresh
    default client (it reads its settings once)."""
    yield from objectservers.serving(servers(scheme), monkeypatch)


def upload(server, folder: str, prefix: str, once: bool = False) -> str:
    """The files of ``folder`` under ``prefix/`` in the bucket; its URL. ``once``: not again
    on this server."""
    if not (once and (folder, prefix) in server.uploaded):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    server.put(BUCKET, f"{prefix}/{name}", f.read())
        server.uploaded.add((folder, prefix))
    return server.url(BUCKET, f"{prefix}/")


def same_pieces(local, remote, n: int) -> int:
    """Every worker's pieces equal, bitwise; the bytes they keep."""
    kept = 0
    for i in range(n):
        a, b = local.worker(i), remote.worker(i)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
            assert torch.equal(
                a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)
            ), (i, name)
            kept += b[name].numel() * b[name].element_size()
    return kept


def data_bytes(path: str) -> int:
    """A safetensors file's tensor bytes (all but its header)."""
    with open(path, "rb") as f:
        return os.path.getsize(path) - 8 - int.from_bytes(f.read(8), "little")


@pytest.fixture
def tiny(server):
    return upload(server, EXAMPLE, "tiny", once=True)


# -- loads equal the local load's ----------------------------------------------------------------


@per_scheme
@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_folder_loads_as_the_local_checkpoint_on_threads(server, tiny, n):
    with ThreadedSession(n) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            server.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
        same_pieces(local, remote, n)
    # the workers of one process fetch together: no byte of the file twice
    assert server.bytes_sent("tiny/model.safetensors") <= os.path.getsize(
        os.path.join(EXAMPLE, "model.safetensors")
    )


@per_scheme
@pytest.mark.parametrize("n, gap_kb", [(2, "0"), (4, "1024")])
def test_worker_processes_share_one_fetch(server, tiny, monkeypatch, n, gap_kb):
    # the loader's process fetches the union of the workers' spans once, into memory they map:
    # every tensor byte once (the header was fetched when the checkpoint was opened), not each
    # process its own parts and the gaps it reads through
    monkeypatch.setenv("SHARDLOAD_OBJECT_MAX_GAP_KB", gap_kb)
    with ProcessSession(n) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            server.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, n)
    sent = server.bytes_sent("tiny/model.safetensors")
    assert sent == data_bytes(os.path.join(EXAMPLE, "model.safetensors")) < kept


@per_scheme
def test_a_worker_that_cannot_map_the_fetched_bytes_fetches_its_own(server, tiny, monkeypatch):
    # the memory file is reached through /proc/<pid>/fd; where a worker cannot open it, it
    # fetches its own spans (in a process of its own, from the environment it was given), and
    # its pieces are the same
    import dataclasses

    from shardload.sources import sparse

    def unreachable(self):  # a memory file no worker can open
        return dataclasses.replace(self.spec(), shared="/proc/self/fd/999999")

    monkeypatch.setattr(sparse.ObjectBytes, "shared_spec", unreachable)
    monkeypatch.setenv("SHARDLOAD_OBJECT_MAX_GAP_KB", "0")
    with ProcessSession(2) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            server.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, 2)
    # the loader's fetch, and each worker's own parts again
    sent = server.bytes_sent("tiny/model.safetensors")
    assert sent == data_bytes(os.path.join(EXAMPLE, "model.safetensors")) + kept


@on("gs")
def test_an_indexed_set_at_n8(server, tmp_path):
    # the example split over two files with an index
    tensors = load_file(os.path.join(EXAMPLE, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    folder = tmp_path / "indexed"
    folder.mkdir()
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, part in files.items():
        save_file({k: tensors[k] for k in part}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}}
        )
    )
    for side in ("config.json", "quantize_config.json"):
        (folder / side).write_bytes(open(os.path.join(EXAMPLE, side), "rb").read())
    url = upload(server, str(folder), "indexed")
    with ThreadedSession(8) as sess:
        local = load_sharded(str(folder), None, sess, progress=False)
        remote = load_sharded(url, None, sess, progress=False)
        same_pieces(local, remote, 8)


def put_file(server, path: str, key: str) -> str:
    with open(path, "rb") as f:
        server.put(BUCKET, key, f.read())
    return server.url(BUCKET, key)


@pytest.mark.slow
@pytest.mark.real_model
@on("gs")
def test_a_real_gguf_at_a_padded_n(server, tmp_path):
    # SmolLM2's 9 heads zero-padded over 2 workers; its header (a 49k-token vocabulary) is
    # fetched a part at a time
    from helpers.real_models import smollm2_gguf

    path = smollm2_gguf()
    url = put_file(server, path, "smollm2/model.gguf")
    with ProcessSession(2) as sess:
        local = load_sharded(path, None, sess, progress=False)
        with open_checkpoint(url) as ckpt:
            server.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, 2)
    # the file once (the workers' union, fetched by the loader's process), where each process
    # fetching its own would send what they keep (the embeddings twice) and more: the rows of
    # the tensors split along their blocks (attn_output, ffn_down) lie under 64 KiB apart
    sent = server.bytes_sent("smollm2/model.gguf")
    assert sent <= os.path.getsize(path) < kept


@on("az")
def test_gguf_and_mlc(server, tmp_path):
    from gguf import GGMLQuantizationType as T
    from helpers.gguf_mlc_models import GGUF_LINEARS, write_gguf, write_mlc_model

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(
        str(gguf_dir / "m.gguf"), dict.fromkeys(GGUF_LINEARS, T.Q4_1), hidden=512, inter=1024
    )
    mlc_dir = tmp_path / "mlc"
    write_mlc_model(str(mlc_dir))
    gguf_url = upload(server, str(gguf_dir), "gguf") + "m.gguf"
    mlc_url = upload(server, str(mlc_dir), "mlc")
    for local_path, url, n in [(str(gguf_dir / "m.gguf"), gguf_url, 2), (str(mlc_dir), mlc_url, 4)]:
        with ProcessSession(n) as sess:
            local = load_sharded(local_path, None, sess, progress=False)
            remote = load_sharded(url, None, sess, progress=False)
            same_pieces(local, remote, n)


# -- the CLI -------------------------------------------------------------------------------------


def _cli(server, *args: str, env: dict | None = None, home: str | None = None):
    """``python -m shardload ARGS`` with the server's settings (``env``: others instead; no
    server: none), and no cloud setting of this process's; (the run, its seconds)."""
    whole = {k: v for k, v in os.environ.items() if not objectservers.is_cloud_setting(k)}
    whole.update(env if env is not None else server.env() if server is not None else {})
    if home is not None:  # no gcloud application default credentials, no ~/.aws
        whole["HOME"] = home
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "shardload", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(whole),
        cwd=REPO,
    )
    return run, time.monotonic() - start


@per_scheme
def test_the_cli_loads_and_inspects_an_object_folder(server, tiny):
    run, _ = _cli(server, "load", "--shards", "2", "--json", tiny)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [w["tensors"] for w in out["workers"]] == [63, 63]
    assert out["checkpoint"] == tiny and out["shard_info"] == tiny + "shard_info.json"
    run, _ = _cli(server, "inspect", "--shards", "2", "--reads", tiny)
    assert run.returncode == 0, run.stderr
    assert "model.safetensors[" in run.stdout


# -- what goes wrong ---------------------------------------------------------------------------


def one_line(run) -> str:
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


@per_scheme
@pytest.mark.parametrize("what", ["empty folder", "missing object", "missing bucket"])
def test_a_wrong_url_is_one_line_exit_2(server, tiny, scheme, what):
    url, phrase = {
        "empty folder": (server.url(BUCKET, "nothing-here/"), "no objects under this prefix"),
        "missing object": (tiny + "missing.safetensors", "no such object"),
        # "no such S3 bucket", "no such Google Cloud Storage bucket", "no such Azure Blob
        # Storage container", and its name
        "missing bucket": (
            server.url("no-such-bucket-here", "tiny/"),
            (f"no such {URL_SCHEMES[scheme].service} {WORD[scheme]} 'no-such-bucket-here'"),
        ),
    }[what]
    run, _ = _cli(server, "load", "--shards", "2", url)
    assert run.returncode == 2, run.stderr
    line = one_line(run)
    assert phrase in line and url in line, line


@per_scheme
def test_no_credentials_is_one_line_exit_2(server, tiny, scheme, tmp_path):
    # the variables unset (set empty, obstore signs with an empty key, which moto takes), and
    # a HOME without gcloud's application default credentials: the client asks the instance
    # metadata service, which is not there (or refuses), and says so in one line, at once
    run, seconds = _cli(
        server,
        "load",
        "--shards",
        "2",
        tiny,
        env=server.env_without_credentials(),
        home=str(tmp_path),
    )
    assert run.returncode == 2, run.stderr
    line = one_line(run)
    assert "credentials" in line.lower() and CREDENTIAL_VARIABLE[scheme] in line, line
    assert tiny in line and seconds < 60


@per_scheme
def test_a_dead_endpoint_is_one_line_exit_1(server, tiny):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        run, seconds = _cli(
            server,
            "load",
            "--shards",
            "2",
            tiny,
            env={**server.env_at(f"http://127.0.0.1:{port}"), "SHARDLOAD_OBJECT_RETRIES": "1"},
        )
    assert run.returncode == 1, run.stderr
    line = one_line(run)
    assert f"127.0.0.1:{port}" in line and tiny in line, line
    assert seconds < 60


@per_scheme
def test_an_object_replaced_mid_load_fails_it(server, tiny):
    url = upload(server, EXAMPLE, "replaced")
    with open_checkpoint(url) as ckpt:
        # replaced after its header was read: the load's GETs name the ETag the listing saw
        # (If-Match), and their answers must carry it (fake-gcs-server ignores If-Match)
        data = open(os.path.join(EXAMPLE, "model.safetensors"), "rb").read()
        server.put(BUCKET, "replaced/model.safetensors", data[:-4] + b"\0\0\0\1")
        # the loader's process fetches for the workers before they start: its GET fails
        for session in (ThreadedSession(2), ProcessSession(2)):
            with session as sess, pytest.raises(FormatError) as info:
                load_sharded(ckpt, None, sess, progress=False)
            assert "changed while loading" in str(info.value)
            assert str(info.value).startswith(url + "model.safetensors")


@per_scheme
def test_slow_down_and_a_dropped_connection_are_retried(server, tiny):
    slow = server.inject("slowdown", key="tiny/model.safetensors", times=2)
    drop = server.inject("drop", after_bytes=1000, key="tiny/model.safetensors", times=1)
    with ThreadedSession(2) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        remote = load_sharded(tiny, None, sess, progress=False)
        same_pieces(local, remote, 2)
    assert slow.hits == 2 and drop.hits == 1


@on("az")
def test_a_hostile_header_is_refused_before_it_is_fetched(server, scheme, tmp_path):
    folder = tmp_path / "hostile"
    folder.mkdir()
    # a header that says it is 90 MB long (under the 100 MB cap) in a 1 MB object
    with open(folder / "model.safetensors", "wb") as f:
        f.write((90_000_000).to_bytes(8, "little") + b"{" + b" " * (1 << 20))
    url = upload(server, str(folder), "hostile")
    server.reset_counts()
    with pytest.raises(FormatError) as info:
        open_checkpoint(url)
    assert "runs past the end" in str(info.value)
    assert str(info.value).startswith(f"{scheme}://")
    assert server.bytes_sent("hostile/model.safetensors") <= 8
    # and a GGUF whose first string claims 50 GB
    os.remove(folder / "model.safetensors")
    header = (
        b"GGUF"
        + (3).to_bytes(4, "little")
        + (0).to_bytes(8, "little")
        + (1).to_bytes(8, "little")
        + (50 << 30).to_bytes(8, "little")
    )
    (folder / "m.gguf").write_bytes(header + bytes(4096))
    url = upload(server, str(folder), "hostile-gguf") + "m.gguf"
    server.reset_counts()
    with pytest.raises(FormatError) as info:
        open_checkpoint(url)
    assert server.bytes_sent("hostile-gguf/m.gguf") <= len(header) + 4096


@pytest.mark.parametrize("scheme", scheme_params("s3", "az"))  # they sign with a secret
def test_no_credential_in_any_message(server, tiny, scheme):
    secrets = SECRETS[scheme]
    for url in (server.url(BUCKET, "nothing-here/"), server.url("no-such-bucket-here", "x/")):
        run, _ = _cli(server, "load", "--json", "--shards", "2", url)
        assert run.returncode == 2 and json.loads(run.stderr)["error"]["type"] == "StorageError"
        assert not any(s in run.stderr + run.stdout for s in secrets)
    with pytest.raises(StorageError) as info:
        open_checkpoint(server.url("no-such-bucket-here", "x/"))
    assert info.value.usage and not any(s in str(info.value) for s in secrets)


def _run_json(server, *args: str) -> dict:
    run, _ = _cli(server, "run", "--json", "--max-new-tokens", "8", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A random tiny Llama saved by transformers, with a tokenizer (tests/helpers/tokenizer.py)."""
    transformers = pytest.importorskip("transformers")
    from helpers.tokenizer import char_tokenizer

    folder = tmp_path_factory.mktemp("tiny-hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_hf_local(tiny_hf):
    """``run`` and ``load_tp_model`` of the local folder, once for every scheme."""
    from shardload.hf import load_tp_model

    run = _run_json(None, "--shards", "2", "--no-chat", "--prompt", "Hello", tiny_hf)
    with ThreadedSession(2) as sess, load_tp_model(tiny_hf, sess) as model:
        logits = model([[3, 17, 42, 5, 88, 11]])
    return run, logits


@per_scheme
def test_run_and_load_tp_model_from_an_object_folder(server, tiny_hf, tiny_hf_local):
    from shardload.hf import load_tp_model

    url = upload(server, tiny_hf, "tiny-hf")
    # the configs and the tokenizer come from the folder's side files, the weights by range
    local, want = tiny_hf_local
    remote = _run_json(server, "--shards", "2", "--no-chat", "--prompt", "Hello", url)
    assert remote["tokens"] == local["tokens"] and remote["text"] == local["text"]
    with ThreadedSession(2) as sess:
        with load_tp_model(url, sess) as model:
            got = model([[3, 17, 42, 5, 88, 11]])
    assert torch.equal(got, want)


@on("gs")
def test_run_refuses_check_from_object_storage(server, tiny):
    run, _ = _cli(server, "run", "--shards", "2", "--prompt", "hi", "--check", tiny)
    assert run.returncode == 2 and "--check" in run.stderr and tiny in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_the_walk_throughs_server_refuses_a_taken_port(tmp_path):
    # docs/objects.md's examples/object_store.py (run as a reader runs it: from elsewhere, no
    # PYTHONPATH): a port something listens on is refused in one line saying how to choose
    # another, before anything is started
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "examples", "object_store.py"),
                "start",
                "s3",
                EXAMPLE,
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(tmp_path),
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
    assert run.returncode == 2 and run.stdout == "", run.stderr
    line = one_line(run)
    assert f"port {port}" in line and "--port" in line, line


@pytest.mark.slow
@pytest.mark.real_model
@on("az")
def test_run_a_real_gguf_from_object_storage(server):
    # the tokenizer is built from the GGUF's vocabulary: its header, fetched by the reader,
    # written into the scratch folder's sparse placeholder for transformers to read
    from helpers.real_models import smollm2_gguf

    path = smollm2_gguf()
    url = put_file(server, path, "run-gguf/model.gguf")
    local = _run_json(server, "--shards", "3", "--prompt", "What is the capital of France?", path)
    server.reset_counts()
    remote = _run_json(server, "--shards", "3", "--prompt", "What is the capital of France?", url)
    assert remote["tokens"] == local["tokens"] and "Paris" in remote["text"]
    # three threads share what they fetch: about the file once (its header is read twice:
    # by the readers, then by transformers' tokenizer from the sparse copy, not the server)
    assert server.bytes_sent("run-gguf/model.gguf") < 1.1 * os.path.getsize(path)


@per_scheme
def test_a_plan_from_object_storage(server, tiny, monkeypatch):
    from shardload import ShardInfo
    from shardload.plan import limits

    plan = tiny + "shard_info.json"
    run, _ = _cli(server, "load", "--shards", "2", "--json", "--shard-info", plan, EXAMPLE)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["shard_info"] == plan
    assert (
        ShardInfo.load(plan).steps == ShardInfo.load(os.path.join(EXAMPLE, "shard_info.json")).steps
    )
    # its size is checked before a byte of it is fetched
    monkeypatch.setattr(limits, "MAX_PLAN_BYTES", 100)
    server.reset_counts()
    with pytest.raises(PlanError, match="over the 100-byte limit"):
        ShardInfo.load(plan)
    assert server.bytes_sent("tiny/shard_info.json") == 0


@on("gs")
def test_an_objects_tensors_are_read_not_viewed(server, tiny):
    # a view would hold (so fetch) the whole tensor; a read fetches the bytes it asks for
    name = "model.layers.0.mlp.down_proj.qweight"
    with open_checkpoint(EXAMPLE) as ckpt:
        assert ckpt.view(name) is not None
        want = ckpt.read_narrow(name, 0, 0, 8)
    with open_checkpoint(tiny) as ckpt:
        server.reset_counts()
        assert ckpt.view(name) is None
        assert torch.equal(ckpt.read_narrow(name, 0, 0, 8), want)
        size = ckpt.meta(name).nbytes
    assert 0 < server.bytes_sent("tiny/model.safetensors") < size


# -- the reliability corpus, served from object storage ------------------------------------------

#: the corpus' classes about what a checkpoint's files hold (the rest are about local file
#: system layouts, configs and plans, which object storage does not change)
CORPUS_CLASSES = {
    "safetensors header",
    "GGUF header",
    "GGUF metadata",
    "MLC index",
    "index file",
    "index file names",
    "truncated file",
    "pathological sizes",
    "legitimate",
    "metadata vs tensors",
}


#: by default, the headers; the other classes under -m extended
HEADER_CLASSES = {"safetensors header", "GGUF header", "MLC index", "truncated file"}


def _corpus():
    """The cases, each on one scheme, the schemes taking turns."""
    from helpers.hostile_corpus import CASES

    params = []
    for default in (True, False):  # the turns counted apart, so that each run takes all three
        cases = [
            c
            for c in CASES
            if c.klass in CORPUS_CLASSES and not c.slow and (c.klass in HEADER_CLASSES) == default
        ]
        for i, c in enumerate(cases):
            scheme = SCHEMES[i % len(SCHEMES)]
            params.append(
                pytest.param(
                    c,
                    scheme,
                    id=f"{c.id}-{scheme}",
                    marks=[] if default else [pytest.mark.extended],
                )
            )
    return params


def _outcome(ckpt_path: str, shards: int):
    """``None`` where the checkpoint loads (its plan beside it, or the planner's), else the
    refusal."""
    from shardload import PlanError, plan_for

    try:
        with open_checkpoint(ckpt_path) as ckpt:
            plan = (
                None
                if any(
                    os.path.basename(f) == "shard_info.json"
                    for f in os.listdir(
                        ckpt.path if os.path.isdir(ckpt.path) else os.path.dirname(ckpt.path)
                    )
                )
                else plan_for(ckpt, shards)
            )
            with ThreadedSession(shards) as sess:
                load_sharded(ckpt, plan, sess, progress=False)
        return None
    except (FormatError, PlanError, StorageError) as exc:
        return exc


@pytest.mark.parametrize("case, scheme", _corpus())
def test_the_corpus_from_object_storage_gets_the_answers_it_gets_from_files(
    server, scheme, case, tmp_path
):
    folder = tmp_path / "case"
    folder.mkdir()
    target = case.build(folder)
    if (
        target.plan is not None
        or any(p.is_symlink() or not (p.is_file() or p.is_dir()) for p in folder.rglob("*"))
        or any(p.is_dir() for p in folder.iterdir())
    ):
        pytest.skip("a layout object storage has no counterpart of (links, FIFOs, folders)")
    local = _outcome(target.ckpt, target.shards)
    prefix = f"corpus/{case.id}"
    url = upload(server, str(folder), prefix)
    rel = os.path.relpath(target.ckpt, folder)
    remote = _outcome(url if rel == "." else url + rel, target.shards)
    if local is None:
        assert remote is None, remote
        return
    assert type(remote) is type(local), (local, remote)
    text = str(remote)
    assert str(folder) not in text and f"shardload-{scheme}-" not in text, text  # says the URL
    for fragment in case.mentions:
        assert fragment in text, (fragment, text)
