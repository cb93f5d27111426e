"""The optional environments (``devtools/environments.py``): one rule finds each, the same as
the script that makes it, only once it is whole; a test that needs one skips naming the script
(fails under CI's ``SHARDLOAD_REQUIRE_*=1``); nothing is installed by looking."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from helpers.environments import require
from helpers.paths import REPO

from devtools import objectservers
from devtools.environments import ENVIRONMENTS, cache_root, environment

ALL = list(ENVIRONMENTS)
_SETTINGS = [
    v for e in ENVIRONMENTS.values() for v in (e.program_env, e.folder_env, e.require_env)
] + ["SHARDLOAD_CACHE"]


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch, tmp_path):
    """None of CI's settings, and a cache of this test's own."""
    for name in _SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHARDLOAD_CACHE", str(tmp_path / "cache"))


def _make(folder: Path, program: str, ready: str | None) -> Path:
    """An environment as its script leaves it: the program, and ``ready`` written last."""
    exe = folder / program
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    if ready is not None:
        (folder / "ready").write_text(ready + "\n")
    return exe


@pytest.mark.parametrize("name", ALL)
def test_each_script_makes_its_environment_where_the_rule_looks(name):
    env = environment(name)
    script = (Path(REPO) / env.script).read_text()
    # its constants (AZURITE=3.37.0) put where the script uses them ("azurite@$AZURITE")
    for constant, value in re.findall(r"^([A-Z_]+)=([^\s\"$]+)$", script, re.M):
        script = script.replace(f"${constant}", value)
    assert env.ready in script, f"{env.script} does not write {env.ready!r} to ready"
    assert (
        f"${{{env.folder_env}:-${{SHARDLOAD_CACHE:-$HOME/.cache/shardload}}/{env.folder}}}"
        in script
    ), f"{env.script} does not make it where {env.folder_env} and the cache say"


@pytest.mark.parametrize("name", ALL)
def test_the_cache_holds_it_once_it_is_whole(name, tmp_path):
    env = environment(name)
    home = cache_root() / env.folder
    assert home == tmp_path / "cache" / env.folder
    assert env.find() is None  # not made
    exe = _make(home, env.program, None)
    assert env.find() is None  # half made: no ready yet
    (home / "ready").write_text("an older version\n")
    assert env.find() is None  # made by another script
    (home / "ready").write_text(env.ready + "\n")
    assert env.find() == str(exe)


@pytest.mark.parametrize("name", ALL)
def test_the_program_named_wins_over_the_folder_named_over_the_cache(name, tmp_path, monkeypatch):
    env = environment(name)
    _make(cache_root() / env.folder, env.program, env.ready)
    in_folder = _make(tmp_path / "folder", env.program, env.ready)
    monkeypatch.setenv(env.folder_env, str(tmp_path / "folder"))
    assert env.find() == str(in_folder)
    named = _make(tmp_path / "named", env.program, env.ready)
    monkeypatch.setenv(env.program_env, str(named))
    assert env.find() == str(named)
    (tmp_path / "named" / "ready").unlink()  # named, but not whole
    assert env.find() is None


@pytest.mark.parametrize("name", ALL)
def test_a_test_needing_it_skips_naming_the_script_or_fails_under_ci(name, monkeypatch):
    env = environment(name)
    with pytest.raises(pytest.skip.Exception, match=f"make it with {env.script}"):
        require(name)
    monkeypatch.setenv(env.require_env, "1")
    with pytest.raises(pytest.fail.Exception, match=f"make it with {env.script}"):
        require(name)
    _make(cache_root() / env.folder, env.program, env.ready)
    assert require(name) == str(cache_root() / env.folder / env.program)


def test_an_unknown_environment_is_named_with_the_known_ones():
    with pytest.raises(
        KeyError, match="no environment 'nope'; they are vllm, quant, azurite, gpu_sim"
    ):
        environment("nope")


def test_looking_for_azurite_installs_nothing(tmp_path, monkeypatch):
    """With npm on the machine, the suite used to install Azurite (361 MB) by itself."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ran = tmp_path / "npm-ran"
    for tool in ("npm", "node", "npx"):
        fake = bin_dir / tool
        fake.write_text(f"#!/bin/sh\ntouch {ran}\n")
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert objectservers.azurite_blob() is None
    assert not ran.exists() and not (cache_root() / "azurite").exists()
