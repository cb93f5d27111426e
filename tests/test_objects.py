"""Checkpoints in object storage (``s3://``), against a real S3 server on 127.0.0.1 (moto's,
behind the counting proxy of ``helpers/s3server.py``): every worker's pieces equal the local
load's, the bytes the server sends are what the workers keep (counted at the server), and the
failures users meet are one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("botocore")
pytest.importorskip("moto")

from conftest import EXAMPLE, REPO, subprocess_env  # noqa: E402
from helpers import s3server  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from shardload import (FormatError, PlanError, ProcessSession, StorageError,  # noqa: E402
                       ThreadedSession, load_sharded, open_checkpoint)
from shardload.sources import s3 as s3_module  # noqa: E402

BUCKET = "models"


@pytest.fixture(scope="module")
def s3():
    yield from s3server.s3_server()


@pytest.fixture
def aws(s3, monkeypatch):
    """This process (and the workers it starts) pointed at the server; a fresh default client
    (it reads its settings once)."""
    s3server.use_env(monkeypatch, s3.aws_env())
    monkeypatch.setattr(s3_module, "_DEFAULT", None)
    s3.clear_faults()
    yield s3
    s3.clear_faults()
    s3_module._DEFAULT = None


def bucket(s3):
    """A botocore client to the server, the bucket made."""
    client = s3.client()
    try:
        client.create_bucket(Bucket=BUCKET)
    except Exception:  # noqa: BLE001 - made by an earlier test
        pass
    return client


def upload(s3, folder: str, prefix: str) -> str:
    client = bucket(s3)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=f.read())
    return f"s3://{BUCKET}/{prefix}/"


def same_pieces(local, remote, n: int) -> int:
    """Every worker's pieces equal, bitwise; the bytes they keep."""
    kept = 0
    for i in range(n):
        a, b = local.worker(i), remote.worker(i)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
            assert torch.equal(a[name].view(-1).view(torch.uint8),
                               b[name].view(-1).view(torch.uint8)), (i, name)
            kept += b[name].numel() * b[name].element_size()
    return kept


@pytest.fixture(scope="module")
def tiny(s3):
    return upload(s3, EXAMPLE, "tiny")


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_folder_loads_as_the_local_checkpoint_on_threads(aws, tiny, n):
    with ThreadedSession(n) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            aws.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
        same_pieces(local, remote, n)
    # the workers of one process fetch together: no byte of the file twice
    assert aws.bytes_sent("tiny/model.safetensors") <= os.path.getsize(
        os.path.join(EXAMPLE, "model.safetensors"))


@pytest.mark.parametrize("n, gap_kb", [(2, "0"), (4, "1024")])
def test_worker_processes_share_one_fetch(aws, tiny, monkeypatch, n, gap_kb):
    # the loader's process fetches the union of the workers' spans once, into memory they map:
    # every tensor byte once (the header was fetched when the checkpoint was opened), not each
    # process its own parts and the gaps it reads through
    monkeypatch.setenv("SHARDLOAD_S3_MAX_GAP_KB", gap_kb)
    path = os.path.join(EXAMPLE, "model.safetensors")
    with open(path, "rb") as f:
        data_bytes = os.path.getsize(path) - 8 - int.from_bytes(f.read(8), "little")
    with ProcessSession(n) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            aws.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, n)
    assert aws.bytes_sent("tiny/model.safetensors") == data_bytes < kept


def test_a_worker_that_cannot_map_the_fetched_bytes_fetches_its_own(aws, tiny, monkeypatch):
    # the memory file is reached through /proc/<pid>/fd; where a worker cannot open it, it
    # fetches its own spans, and its pieces are the same
    from shardload.sources import sparse

    def unreachable(self):  # a memory file no worker can open, said to hold everything
        return {**self.spec(), "filled": {"path": "/proc/self/fd/999999",
                                          "spans": [[0, self.size]]}}

    monkeypatch.setattr(sparse.ObjectBytes, "filled_spec", unreachable)
    monkeypatch.setenv("SHARDLOAD_S3_MAX_GAP_KB", "0")
    with ProcessSession(2) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        with open_checkpoint(tiny) as ckpt:
            aws.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, 2)
    # the loader's fetch, and each worker's own parts again
    path = os.path.join(EXAMPLE, "model.safetensors")
    with open(path, "rb") as f:
        data_bytes = os.path.getsize(path) - 8 - int.from_bytes(f.read(8), "little")
    assert aws.bytes_sent("tiny/model.safetensors") == data_bytes + kept


def test_an_indexed_set_at_n8(aws, tmp_path):
    # the example split over two files with an index
    tensors = load_file(os.path.join(EXAMPLE, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    folder = tmp_path / "indexed"
    folder.mkdir()
    files = {"model-00001-of-00002.safetensors": names[:half],
             "model-00002-of-00002.safetensors": names[half:]}
    for file, part in files.items():
        save_file({k: tensors[k] for k in part}, str(folder / file))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}}))
    for side in ("config.json", "quantize_config.json"):
        (folder / side).write_bytes(open(os.path.join(EXAMPLE, side), "rb").read())
    url = upload(aws, str(folder), "indexed")
    with ThreadedSession(8) as sess:
        local = load_sharded(str(folder), None, sess, progress=False)
        remote = load_sharded(url, None, sess, progress=False)
        same_pieces(local, remote, 8)


@pytest.mark.slow
@pytest.mark.real_model
def test_a_real_gguf_at_a_padded_n(aws, tmp_path):
    # SmolLM2's 9 heads zero-padded over 2 workers; its header (a 49k-token vocabulary) is
    # fetched a part at a time
    from helpers.real_models import smollm2_gguf

    path = smollm2_gguf()
    client = bucket(aws)
    with open(path, "rb") as f:
        client.put_object(Bucket=BUCKET, Key="smollm2/model.gguf", Body=f.read())
    with ProcessSession(2) as sess:
        local = load_sharded(path, None, sess, progress=False)
        with open_checkpoint(f"s3://{BUCKET}/smollm2/model.gguf") as ckpt:
            aws.reset_counts()
            remote = load_sharded(ckpt, None, sess, progress=False)
            kept = same_pieces(local, remote, 2)
    # the file once (the workers' union, fetched by the loader's process), where each process
    # fetching its own would send what they keep (the embeddings twice) and more: the rows of
    # the tensors split along their blocks (attn_output, ffn_down) lie under 64 KiB apart
    sent = aws.bytes_sent("smollm2/model.gguf")
    assert sent <= os.path.getsize(path) < kept


def test_gguf_and_mlc(aws, tmp_path):
    from gguf import GGMLQuantizationType as T

    from test_planner_gguf_mlc import GGUF_LINEARS, write_gguf, write_mlc_model

    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(str(gguf_dir / "m.gguf"), dict.fromkeys(GGUF_LINEARS, T.Q4_1), hidden=512,
               inter=1024)
    mlc_dir = tmp_path / "mlc"
    write_mlc_model(str(mlc_dir))
    gguf_url = upload(aws, str(gguf_dir), "gguf") + "m.gguf"
    mlc_url = upload(aws, str(mlc_dir), "mlc")
    for local_path, url, n in [(str(gguf_dir / "m.gguf"), gguf_url, 2),
                               (str(mlc_dir), mlc_url, 4)]:
        with ProcessSession(n) as sess:
            local = load_sharded(local_path, None, sess, progress=False)
            remote = load_sharded(url, None, sess, progress=False)
            same_pieces(local, remote, n)


def test_the_cli_loads_and_inspects_an_object_folder(aws, tiny):
    env = subprocess_env(aws.env())
    run = subprocess.run([sys.executable, "-m", "shardload", "load", "--shards", "2", "--json",
                          tiny], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert [w["tensors"] for w in out["workers"]] == [63, 63]
    assert out["checkpoint"] == tiny and out["shard_info"] == tiny + "shard_info.json"
    run = subprocess.run([sys.executable, "-m", "shardload", "inspect", "--shards", "2",
                          "--reads", tiny], capture_output=True, text=True, timeout=120,
                         env=env, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "model.safetensors[" in run.stdout


# -- what goes wrong ---------------------------------------------------------------------------

def _cli(aws, *args: str, env_changes: dict | None = None):
    env = subprocess_env({**aws.env(), **(env_changes or {})})
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "shardload", *args], capture_output=True,
                         text=True, timeout=120, env=env, cwd=REPO)
    return run, time.monotonic() - start


@pytest.mark.parametrize("url, code, phrase", [
    ("s3://models/nothing-here/", 2, "no objects under this prefix"),
    ("s3://models/tiny/missing.safetensors", 2, "no such"),
    ("s3://no-such-bucket-here/tiny/", 2, "no such bucket"),
])
def test_a_wrong_url_is_one_line_exit_2(aws, tiny, url, code, phrase):
    run, _ = _cli(aws, "load", "--shards", "2", url)
    assert run.returncode == code, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0].lower() and "s3://" in lines[0], run.stderr


def test_no_credentials_and_a_dead_endpoint(aws, tiny):
    run, _ = _cli(aws, "load", "--shards", "2", tiny,
                  env_changes={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    assert run.returncode == 2 and "credentials" in run.stderr.lower(), run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run, seconds = _cli(aws, "load", "--shards", "2", tiny, env_changes={
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "SHARDLOAD_S3_RETRIES": "1"})
    assert run.returncode == 1, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and f"127.0.0.1:{port}" in run.stderr
    assert seconds < 60


def test_an_object_replaced_mid_load_fails_it(aws, tiny, tmp_path):
    url = upload(aws, EXAMPLE, "replaced")
    with open_checkpoint(url) as ckpt:
        # replaced after its header was read: the load's GETs name the ETag the listing saw
        data = open(os.path.join(EXAMPLE, "model.safetensors"), "rb").read()
        aws.client().put_object(Bucket=BUCKET, Key="replaced/model.safetensors",
                                Body=data[:-4] + b"\0\0\0\1")
        # the loader's process fetches for the workers before they start: its GET fails
        for session in (ThreadedSession(2), ProcessSession(2)):
            with session as sess, pytest.raises(FormatError) as info:
                load_sharded(ckpt, None, sess, progress=False)
            assert "changed while loading" in str(info.value)
            assert str(info.value).startswith(url + "model.safetensors")


def test_slow_down_and_a_dropped_connection_are_retried(aws, tiny):
    slow = aws.inject("slowdown", key="tiny/model.safetensors", times=2)
    drop = aws.inject("drop", after_bytes=1000, key="tiny/model.safetensors", times=1)
    with ThreadedSession(2) as sess:
        local = load_sharded(EXAMPLE, None, sess, progress=False)
        remote = load_sharded(tiny, None, sess, progress=False)
        same_pieces(local, remote, 2)
    assert slow.hits == 2 and drop.hits == 1


def test_a_hostile_header_is_refused_before_it_is_fetched(aws, tmp_path):
    folder = tmp_path / "hostile"
    folder.mkdir()
    # a header that says it is 90 MB long (under the 100 MB cap) in a 1 MB object
    with open(folder / "model.safetensors", "wb") as f:
        f.write((90_000_000).to_bytes(8, "little") + b"{" + b" " * (1 << 20))
    url = upload(aws, str(folder), "hostile")
    aws.reset_counts()
    with pytest.raises(FormatError) as info:
        open_checkpoint(url)
    assert "runs past the end" in str(info.value) and str(info.value).startswith("s3://")
    assert aws.bytes_sent("hostile/model.safetensors") <= 8
    # and a GGUF whose first string claims 50 GB
    os.remove(folder / "model.safetensors")
    header = (b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little")
              + (1).to_bytes(8, "little") + (50 << 30).to_bytes(8, "little"))
    (folder / "m.gguf").write_bytes(header + bytes(4096))
    url = upload(aws, str(folder), "hostile-gguf") + "m.gguf"
    aws.reset_counts()
    with pytest.raises(FormatError) as info:
        open_checkpoint(url)
    assert aws.bytes_sent("hostile-gguf/m.gguf") <= len(header) + 4096


def test_no_credential_in_any_message(aws, tiny):
    secret = aws.aws_env()["AWS_SECRET_ACCESS_KEY"]
    key_id = aws.aws_env()["AWS_ACCESS_KEY_ID"]
    for url in ("s3://models/nothing-here/", "s3://no-such-bucket-here/x/"):
        run, _ = _cli(aws, "load", "--json", "--shards", "2", url)
        assert run.returncode == 2 and json.loads(run.stderr)["error"]["type"] == "StorageError"
        assert secret not in run.stderr + run.stdout and key_id not in run.stderr + run.stdout
    with pytest.raises(StorageError) as info:
        open_checkpoint("s3://no-such-bucket-here/x/")
    assert info.value.usage and secret not in str(info.value) and key_id not in str(info.value)


def _run_json(aws, *args: str) -> dict:
    run, _ = _cli(aws, "run", "--json", "--max-new-tokens", "8", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A random tiny Llama saved by transformers, with a tokenizer (tests/helpers/tokenizer.py)."""
    transformers = pytest.importorskip("transformers")
    from helpers.tokenizer import char_tokenizer

    folder = tmp_path_factory.mktemp("tiny-hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=96)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return str(folder)


def test_run_and_load_tp_model_from_an_object_folder(aws, tiny_hf):
    from shardload.hf import load_tp_model

    url = upload(aws, tiny_hf, "tiny-hf")
    # the configs and the tokenizer come from the folder's side files, the weights by range
    local = _run_json(aws, "--shards", "2", "--no-chat", "--prompt", "Hello", tiny_hf)
    remote = _run_json(aws, "--shards", "2", "--no-chat", "--prompt", "Hello", url)
    assert remote["tokens"] == local["tokens"] and remote["text"] == local["text"]
    prompt = [[3, 17, 42, 5, 88, 11]]
    with ThreadedSession(2) as sess:
        with load_tp_model(tiny_hf, sess) as model:
            want = model(prompt)
        with load_tp_model(url, sess) as model:
            got = model(prompt)
    assert torch.equal(got, want)


def test_run_refuses_check_from_object_storage(aws, tiny):
    run, _ = _cli(aws, "run", "--shards", "2", "--prompt", "hi", "--check", tiny)
    assert run.returncode == 2 and "--check" in run.stderr and tiny in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.real_model
def test_run_a_real_gguf_from_object_storage(aws):
    # the tokenizer is built from the GGUF's vocabulary: its header, fetched by the reader,
    # written into the scratch folder's sparse placeholder for transformers to read
    from helpers.real_models import smollm2_gguf

    path = smollm2_gguf()
    client = bucket(aws)
    with open(path, "rb") as f:
        client.put_object(Bucket=BUCKET, Key="run-gguf/model.gguf", Body=f.read())
    url = f"s3://{BUCKET}/run-gguf/model.gguf"
    local = _run_json(aws, "--shards", "3", "--prompt", "What is the capital of France?", path)
    aws.reset_counts()
    remote = _run_json(aws, "--shards", "3", "--prompt", "What is the capital of France?", url)
    assert remote["tokens"] == local["tokens"] and "Paris" in remote["text"]
    # three threads share what they fetch: about the file once (its header is read twice:
    # by the readers, then by transformers' tokenizer from the sparse copy, not the server)
    assert aws.bytes_sent("run-gguf/model.gguf") < 1.1 * os.path.getsize(path)


def test_a_plan_from_object_storage(aws, tiny, monkeypatch):
    from shardload import ShardInfo
    from shardload.plan import limits

    plan = tiny + "shard_info.json"
    run, _ = _cli(aws, "load", "--shards", "2", "--json", "--shard-info", plan, EXAMPLE)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["shard_info"] == plan
    assert ShardInfo.load(plan).steps == ShardInfo.load(
        os.path.join(EXAMPLE, "shard_info.json")).steps
    # its size is checked before a byte of it is fetched
    monkeypatch.setattr(limits, "MAX_PLAN_BYTES", 100)
    aws.reset_counts()
    with pytest.raises(PlanError, match="over the 100-byte limit"):
        ShardInfo.load(plan)
    assert aws.bytes_sent("tiny/shard_info.json") == 0


def test_an_objects_tensors_are_read_not_viewed(aws, tiny):
    # a view would hold (so fetch) the whole tensor; a read fetches the bytes it asks for
    name = "model.layers.0.mlp.down_proj.qweight"
    with open_checkpoint(EXAMPLE) as ckpt:
        assert ckpt.view(name) is not None
        want = ckpt.read_narrow(name, 0, 0, 8)
    with open_checkpoint(tiny) as ckpt:
        aws.reset_counts()
        assert ckpt.view(name) is None
        assert torch.equal(ckpt.read_narrow(name, 0, 0, 8), want)
        size = ckpt.meta(name).nbytes
    assert 0 < aws.bytes_sent("tiny/model.safetensors") < size


# -- the reliability corpus, served from S3 -----------------------------------------------------

#: the corpus' classes about what a checkpoint's files hold (the rest are about local file
#: system layouts, configs and plans, which object storage does not change)
CORPUS_CLASSES = {"safetensors header", "GGUF header", "GGUF metadata", "MLC index",
                  "index file", "index file names", "truncated file", "pathological sizes",
                  "legitimate", "metadata vs tensors"}


#: by default, the headers; the other classes under -m extended
HEADER_CLASSES = {"safetensors header", "GGUF header", "MLC index", "truncated file"}


def _corpus():
    from helpers.hostile_corpus import CASES

    return [pytest.param(c, id=c.id, marks=[] if c.klass in HEADER_CLASSES
                         else [pytest.mark.extended])
            for c in CASES if c.klass in CORPUS_CLASSES and not c.slow]


def _outcome(ckpt_path: str, shards: int):
    """``None`` where the checkpoint loads (its plan beside it, or the planner's), else the
    refusal."""
    from shardload import PlanError, plan_for

    try:
        with open_checkpoint(ckpt_path) as ckpt:
            plan = None if any(os.path.basename(f) == "shard_info.json"
                               for f in os.listdir(ckpt.path if os.path.isdir(ckpt.path)
                                                   else os.path.dirname(ckpt.path))) \
                else plan_for(ckpt, shards)
            with ThreadedSession(shards) as sess:
                load_sharded(ckpt, plan, sess, progress=False)
        return None
    except (FormatError, PlanError, StorageError) as exc:
        return exc


@pytest.mark.parametrize("case", _corpus())
def test_the_corpus_from_s3_gets_the_answers_it_gets_from_files(aws, case, tmp_path):
    folder = tmp_path / "case"
    folder.mkdir()
    target = case.build(folder)
    if target.plan is not None or any(p.is_symlink() or not (p.is_file() or p.is_dir())
                                      for p in folder.rglob("*")) \
            or any(p.is_dir() for p in folder.iterdir()):
        pytest.skip("a layout object storage has no counterpart of (links, FIFOs, folders)")
    local = _outcome(target.ckpt, target.shards)
    prefix = f"corpus/{case.id}"
    url = upload(aws, str(folder), prefix)
    rel = os.path.relpath(target.ckpt, folder)
    remote = _outcome(url if rel == "." else url + rel, target.shards)
    if local is None:
        assert remote is None, remote
        return
    assert type(remote) is type(local), (local, remote)
    text = str(remote)
    assert str(folder) not in text and "shardload-s3-" not in text, text  # says the URL
    for fragment in case.mentions:
        assert fragment in text, (fragment, text)
