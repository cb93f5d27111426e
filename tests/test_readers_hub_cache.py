"""A checkpoint in the Hugging Face hub cache layout loads, equal to the same one in a plain folder.

``huggingface_hub`` keeps a model as ``models--org--name/{blobs,snapshots,refs}``: each file of a
snapshot is a *relative* symlink ``../../blobs/<etag>`` (the sha256 of the content for LFS files
such as safetensors shards, the git blob sha1 for small text files), and ``refs/main`` holds the
commit hash of the snapshot ``main`` pointed at. No hub is reachable from the tests, so the
layout is built here byte for byte the way ``huggingface_hub`` writes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from shardload import ThreadedSession, load_sharded
from shardload.cli import cli
from shardload.errors import FormatError
from shardload.readers import open_checkpoint
from shardload.readers.hub_cache import resolve_snapshot

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny_llama_q4"
COMMIT = hashlib.sha1(b"shardload test commit").hexdigest()
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
SIDE_FILES = ("config.json", "quantize_config.json", "shard_info.json")


def _write_plain(folder: Path) -> Path:
    """The example model as an HF-sharded folder of two files and an index, with its config
    and plan: ordinary files."""
    folder.mkdir(parents=True)
    tensors = load_file(str(EXAMPLE / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for file_name, part in zip(SHARDS, (names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n in part})
    total = sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    for name in SIDE_FILES:
        shutil.copyfile(EXAMPLE / name, folder / name)
    return folder


def _etag(path: Path) -> str:
    """What huggingface_hub names a blob: sha256 for LFS files, git's blob sha1 otherwise."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_hub_cache(
    cache: Path, plain: Path, repo: str = "models--test-org--tiny-llama-q4"
) -> Path:
    """``plain``'s files laid out as huggingface_hub's cache; returns the repository folder."""
    repo_dir = cache / repo
    blobs, snapshot = repo_dir / "blobs", repo_dir / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)  # the bare hash, no newline
    for src in sorted(plain.iterdir()):
        blob = blobs / _etag(src)
        shutil.copyfile(src, blob)
        pointer = snapshot / src.name
        # huggingface_hub's _create_symlink: relative to the pointer's folder
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    return repo_dir


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(plain folder, hub repository folder, its snapshot folder)."""
    base = tmp_path_factory.mktemp("hub")
    plain = _write_plain(base / "plain")
    repo = _write_hub_cache(base / "hub", plain)
    return plain, repo, repo / "snapshots" / COMMIT


def test_the_layout_is_what_huggingface_hub_writes(layout):
    plain, repo, snapshot = layout
    assert (repo / "refs" / "main").read_text() == COMMIT
    for name in (*SHARDS, "model.safetensors.index.json", *SIDE_FILES):
        pointer = snapshot / name
        assert pointer.is_symlink()
        target = os.readlink(pointer)
        assert target.startswith("../../blobs/") and not os.path.isabs(target)
        assert pointer.resolve().parent == (repo / "blobs").resolve()
    shard_blob = os.path.basename(os.readlink(snapshot / SHARDS[0]))
    assert shard_blob == hashlib.sha256((plain / SHARDS[0]).read_bytes()).hexdigest()


def test_huggingface_hub_itself_reads_the_layout_as_its_cache(layout):
    # not only our idea of the layout: huggingface_hub's own cache scanner accepts it
    import huggingface_hub as hub  # installed with tokenizers and transformers (test extra)

    plain, repo, snapshot = layout
    scan = hub.scan_cache_dir(repo.parent)
    assert scan.warnings == []
    (info,) = scan.repos
    assert (info.repo_id, info.repo_type) == ("test-org/tiny-llama-q4", "model")
    (revision,) = info.revisions
    assert revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert revision.snapshot_path == snapshot
    assert {f.file_name for f in revision.files} == {p.name for p in plain.iterdir()}


@pytest.mark.parametrize("which", ["snapshot", "repo"])
def test_every_tensor_equals_the_plain_folder(layout, which):
    plain, repo, snapshot = layout
    path = snapshot if which == "snapshot" else repo
    with open_checkpoint(plain) as want, open_checkpoint(path) as got:
        assert got.path == str(snapshot)  # where shard_info.json and config.json lie
        assert got.names() == want.names()
        assert len(got.names()) == 63
        for name in want.names():
            assert got.meta(name) == want.meta(name)
            a, b = got.read(name), want.read(name)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert got.config == want.config  # config.json and quantize_config.json are links too
        assert got.config["quantization_config"]["bits"] == 4
        # the index's file names were checked by name; the files opened are the links
        assert got.files == [str(snapshot / s) for s in SHARDS]


def test_a_snapshot_path_as_a_string_with_a_trailing_slash(layout):
    _, repo, snapshot = layout
    assert resolve_snapshot(str(repo) + os.sep) == os.path.join(
        str(repo) + os.sep, "snapshots", COMMIT
    )
    assert resolve_snapshot(snapshot) == str(snapshot)  # anything else is left alone


@pytest.mark.parametrize("which", ["snapshot", "repo"])
def test_load_sharded_equals_the_plain_folder(layout, which):
    plain, repo, snapshot = layout
    path = snapshot if which == "snapshot" else repo
    plan = str(snapshot / "shard_info.json")  # a link to a blob, read like any plan
    with ThreadedSession(num_workers=2) as sess:
        want = load_sharded(
            open_checkpoint(plain), str(plain / "shard_info.json"), sess, progress=False
        )
        got = load_sharded(open_checkpoint(path), plan, sess, progress=False)
        with open_checkpoint(plain) as ckpt:
            names = ckpt.names()
        for name in names:
            for worker in range(2):
                a, b = got.shard(name, worker), want.shard(name, worker)
                assert a.dtype == b.dtype and torch.equal(a, b), (name, worker)


@pytest.mark.parametrize("which", ["plain", "snapshot", "repo"])
def test_cli_load(layout, which):
    plain, repo, snapshot = layout
    path = {"plain": plain, "snapshot": snapshot, "repo": repo}[which]
    result = CliRunner().invoke(cli, ["load", "--shards", "2", "--json", str(path)])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    reference = CliRunner().invoke(cli, ["load", "--shards", "2", "--json", str(plain)])
    assert reference.exit_code == 0, reference.output
    want = json.loads(reference.stdout)["workers"]
    assert [(w["tensors"], w["bytes"]) for w in report["workers"]] == [
        (w["tensors"], w["bytes"]) for w in want
    ]
    assert all(w["tensors"] == 63 for w in report["workers"])


# ----------------------------------------------------------------------------------------------
# a repository folder whose refs/main does not lead to a snapshot


def _bare_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "models--org--name"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "blobs").mkdir()
    return repo


@pytest.mark.parametrize(
    "ref, fragment",
    [
        ("../../../etc", "holds a path separator"),
        ("..", "is '.' or '..'"),
        ("", "is empty"),
        ("a\x00b", "holds a NUL or control character"),
        ("f" * 40, "refs/main names revision 'ffffffffffffffffffffffffffffffffffffffff', but"),
    ],
)
def test_a_bad_ref_is_refused(tmp_path, ref, fragment):
    repo = _bare_repo(tmp_path)
    (repo / "refs" / "main").write_text(ref)
    with pytest.raises(FormatError, match=fragment.replace("(", r"\(").replace(".", r"\.")) as e:
        open_checkpoint(repo)
    assert e.value.file == str(repo / "refs" / "main")


def test_a_ref_with_a_newline_is_read(tmp_path):
    repo = _bare_repo(tmp_path)
    (repo / "refs" / "main").write_text(COMMIT + "\n")
    assert resolve_snapshot(repo) == str(repo / "snapshots" / COMMIT)


def test_no_refs_main_names_the_snapshots(tmp_path):
    repo = _bare_repo(tmp_path)
    (repo / "snapshots" / ("f" * 40)).mkdir()  # two snapshots, no ref: which one is meant?
    with pytest.raises(FormatError, match=f"no refs/main: pass a snapshot folder.*'{COMMIT}'") as e:
        open_checkpoint(repo)
    assert e.value.file == str(repo)


@pytest.mark.parametrize("kind", ["fifo", "folder", "huge", "not utf-8"])
def test_refs_main_must_be_a_small_text_file(tmp_path, kind):
    repo = _bare_repo(tmp_path)
    ref = repo / "refs" / "main"
    if kind == "fifo":
        os.mkfifo(ref)
    elif kind == "folder":
        ref.mkdir()
    elif kind == "huge":
        ref.write_text("a" * 5000)
    else:
        ref.write_bytes(b"\xff\xfe" + COMMIT.encode("utf-16-le"))
    fragment = {
        "fifo": "is a FIFO",
        "folder": "is a directory",
        "huge": "over the 1024-byte",
        "not utf-8": "not UTF-8 text",
    }[kind]
    with pytest.raises(FormatError, match=fragment) as e:
        open_checkpoint(repo)
    assert e.value.file == str(ref)


def test_a_snapshot_of_a_single_file_and_a_gguf_link(tmp_path):
    """One ``model.safetensors`` (and a ``.gguf``) as links into blobs/."""
    blobs = tmp_path / "repo" / "blobs"
    snapshot = tmp_path / "repo" / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    src = tmp_path / "model.safetensors"
    save_file({"x": x}, str(src))
    blob = blobs / hashlib.sha256(src.read_bytes()).hexdigest()
    src.rename(blob)
    os.symlink(f"../../blobs/{blob.name}", snapshot / "model.safetensors")
    for path in (snapshot, snapshot / "model.safetensors"):
        with open_checkpoint(path) as ckpt:
            assert np.array_equal(ckpt.read("x").numpy(), x)

    import gguf

    src = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_tensor("x", x)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blob = blobs / hashlib.sha256(src.read_bytes()).hexdigest()
    src.rename(blob)
    os.symlink(f"../../blobs/{blob.name}", snapshot / "model.gguf")
    with open_checkpoint(snapshot / "model.gguf") as ckpt:
        assert np.array_equal(ckpt.read("x").numpy(), x)


def test_a_repo_folder_without_refs_opens_its_one_snapshot(tmp_path):
    # a download by commit hash writes no refs/main: one snapshot is the only reading
    from helpers.hostile_corpus import hub_target

    repo = Path(hub_target("repo")(tmp_path).ckpt)
    shutil.rmtree(repo / "refs")
    with open_checkpoint(repo) as ckpt:
        assert ckpt.path == str(repo / "snapshots" / ("a" * 40))
        assert sorted(ckpt.names()) == ["a", "b"]
    (repo / "snapshots" / ("b" * 40)).mkdir()  # two snapshots and no ref: which one?
    with pytest.raises(FormatError, match="no refs/main"):
        open_checkpoint(repo)
