"""The shard-function registry: registration, lookup, and where plugins come from."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers.subprocesses import subprocess_env

from shardload import (
    ArrayCheckpoint,
    ThreadedSession,
    UnknownShardFunctionError,
    get_shard_func,
    list_shard_funcs,
    load_plugins,
    load_sharded,
    register_shard_func,
    registry,
)


def test_decorator_and_call_forms():
    @register_shard_func("tests.reg.deco")
    def deco(input, dim, output):
        """Decorated."""

    def plain(input, output):
        """Called.

        More text that is not the summary.
        """

    assert register_shard_func("tests.reg.call", plain, array="numpy") is plain
    assert get_shard_func("tests.reg.deco").func is deco
    entry = get_shard_func("tests.reg.call")
    assert (entry.array, entry.nargs, entry.doc) == ("numpy", (0, 0), "Called.")
    assert get_shard_func("tests.reg.deco").nargs == (1, 1)


def test_duplicates_fail_unless_override():
    register_shard_func("tests.reg.dup", lambda input, output: None)
    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_shard_func("tests.reg.dup", lambda input, output: None)

    def replacement(input, output):
        pass

    register_shard_func("tests.reg.dup", replacement, override=True)
    assert get_shard_func("tests.reg.dup").func is replacement


def test_builtins_cannot_be_silently_replaced():
    with pytest.raises(ValueError, match="already registered"):
        register_shard_func("shardload.split", lambda input, dim, output: None)


def test_unknown_name_is_a_keyerror_with_suggestions():
    with pytest.raises(KeyError) as info:
        get_shard_func("shardload.replicat")
    err = info.value
    assert isinstance(err, UnknownShardFunctionError)
    assert err.suggestions[0] == "shardload.replicate"
    assert "Did you mean 'shardload.replicate'" in str(err)


def test_unknown_name_without_close_match_lists_how_to_register():
    with pytest.raises(UnknownShardFunctionError) as info:
        get_shard_func("zzz")
    assert info.value.suggestions == []
    # the Python message names the API; the CLI shows the same message with its flags
    assert "plugins=[MODULE, ...]" in str(info.value) and "list_shard_funcs()" in str(info.value)
    from shardload.errors import cli_text

    assert "--plugin MODULE" in cli_text(info.value) and "shardload funcs" in cli_text(info.value)
    assert "--" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(name=""), ValueError),
        (dict(name=" x"), ValueError),
        (dict(name=3), ValueError),
        (dict(name="tests.reg.a", array="jax"), ValueError),
    ],
)
def test_bad_registrations(kwargs, exc):
    name = kwargs.pop("name")
    with pytest.raises(exc):
        register_shard_func(name, lambda input, output: None, **kwargs)


def test_function_must_take_input_and_output():
    with pytest.raises(TypeError, match="must take"):
        register_shard_func("tests.reg.bad", lambda output: None)


def test_arity_with_defaults_and_varargs():
    def defaults(input, dim, chunks=1, output=None):
        pass

    def variadic(input, dim, *rest):
        pass

    register_shard_func("tests.reg.defaults", defaults)
    register_shard_func("tests.reg.variadic", variadic)
    d, v = get_shard_func("tests.reg.defaults"), get_shard_func("tests.reg.variadic")
    # input and output are always passed, so any 0..2 extra args fit this signature
    assert d.nargs == (0, 2) and d.accepts(1) and d.accepts(2) and not d.accepts(3)
    assert v.nargs == (1, None) and v.accepts(5) and not v.accepts(0)


def test_list_is_sorted_and_has_the_builtins():
    names = [f.name for f in list_shard_funcs()]
    assert names == sorted(names)
    assert {
        "shardload.split",
        "shardload.split_segments",
        "shardload.replicate",
        "shardload.split_rebase",
    } <= set(names)


def test_plugin_module_named_by_the_user(tmp_path, monkeypatch):
    (tmp_path / "my_shard_plugin.py").write_text(
        textwrap.dedent("""
        from shardload import register_shard_func

        @register_shard_func("my_org.halves", array="numpy")
        def halves(input, output):
            '''Two halves of axis 0.'''
            output[...] = input.reshape(output.shape)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_shard_plugin", raising=False)
    load_plugins(["my_shard_plugin"])
    assert get_shard_func("my_org.halves").doc == "Two halves of axis 0."


def test_plugin_that_does_not_import():
    with pytest.raises(ImportError, match="cannot import shard-function plugin 'no_such_mod_x'"):
        load_plugins(["no_such_mod_x"])


def test_entry_point_plugins_are_loaded(tmp_path, monkeypatch):
    # A real installed distribution, as pip would lay it out, advertising the entry point.
    (tmp_path / "ep_plugin_mod.py").write_text(
        textwrap.dedent("""
        from shardload import register_shard_func

        @register_shard_func("ep_org.split0")
        def split0(input, output):
            '''Split axis 0 (from an entry point).'''
            output.copy_(input.reshape(output.shape))
    """)
    )
    dist = tmp_path / "ep_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[shardload.shard_functions]\nep_plugin = ep_plugin_mod\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ep_plugin_mod", raising=False)
    assert "ep_plugin" in registry.load_entry_points()
    assert get_shard_func("ep_org.split0").doc.startswith("Split axis 0")


def test_entry_points_load_on_first_lookup(tmp_path):
    # The registry scans the group by itself the first time it is used: in a fresh interpreter,
    # whose first use of the registry is this lookup.
    (tmp_path / "ep_lazy_mod.py").write_text(
        "from shardload import register_shard_func\n"
        "register_shard_func('ep_org.lazy', lambda input, output: None)\n"
    )
    dist = tmp_path / "ep_lazy-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-lazy\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[shardload.shard_functions]\nlazy = ep_lazy_mod\n")
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    script = (
        "import sys\n"
        "from shardload import get_shard_func\n"
        "assert 'ep_lazy_mod' not in sys.modules\n"
        "print(get_shard_func('ep_org.lazy').name)\n"
    )
    # a hang guard: a fresh interpreter importing shardload, 1.2-1.9 s (measured on 2 shared cores)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ep_org.lazy"]


def test_broken_entry_point_is_named(tmp_path, monkeypatch):
    dist = tmp_path / "ep_broken-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-broken\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[shardload.shard_functions]\nbroken = no_such_module_for_ep\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="entry point 'broken'"):
        registry.load_entry_points()


def test_a_plan_never_imports_what_it_names(tmp_path, monkeypatch):
    # A module that would register the function if imported: naming it in a plan must not.
    (tmp_path / "sneaky_mod.py").write_text(
        "import shardload\nshardload.register_shard_func('sneaky_mod.f', "
        "lambda input, output: None)\nIMPORTED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plan = {"w": [["sneaky_mod.f", [[2, 2], "float32"]]]}
    with ThreadedSession(2) as sess, pytest.raises(UnknownShardFunctionError):
        load_sharded(ArrayCheckpoint({"w": np.zeros(4, np.float32)}), plan, sess, progress=False)
    assert "sneaky_mod" not in sys.modules


# ---- the one table both registries are built on (shardload.table) --------------------------------


def test_both_registries_keep_their_messages():
    from shardload.errors import UnknownSessionFunctionError
    from shardload.sessions import functions as session_functions

    def first(input, output):
        pass

    def second(input, output):
        pass

    for register, kind in (
        (register_shard_func, "shard function"),
        (session_functions.register_session_func, "session function"),
    ):
        register("tests.reg.table", first)
        register("tests.reg.table", first)  # the same function again: harmless
        with pytest.raises(ValueError) as info:
            register("tests.reg.table", second)
        assert type(info.value) is ValueError
        assert str(info.value) == (
            f"{kind} 'tests.reg.table' is already registered (by "
            f"{first.__module__}); pass override=True to replace it"
        )
        register("tests.reg.table", second, override=True)
    assert get_shard_func("tests.reg.table").func is second
    assert session_functions.get_session_func("tests.reg.table").func is second
    registry.unregister_shard_func("tests.reg.table")
    session_functions.unregister_session_func("tests.reg.table")
    session_functions.unregister_session_func("tests.reg.table")  # unknown: nothing happens
    with pytest.raises(UnknownShardFunctionError) as shard:
        get_shard_func("tests.reg.tabel")
    with pytest.raises(UnknownSessionFunctionError) as session:
        session_functions.get_session_func("shardload.load_piece")
    assert type(shard.value) is UnknownShardFunctionError and shard.value.name == "tests.reg.tabel"
    assert type(session.value) is UnknownSessionFunctionError
    assert session.value.suggestions[0] == "shardload.load_pieces"
    names = [f.name for f in session_functions.list_session_funcs()]
    assert names == sorted(names) and "shardload.load_pieces" in names


def test_a_table_of_any_entries():
    from dataclasses import dataclass

    from shardload.table import Table

    @dataclass(frozen=True)
    class Kind:
        name: str
        size: int
        module: str = ""

    table = Table(
        "session kind",
        lambda name, known: LookupError(name, sorted(known)),
        same=lambda old, new: old.size == new.size,
    )
    assert table.add(Kind("thread", 1, "mine")) == Kind("thread", 1, "mine")
    table.add(Kind("process", 2))
    table.add(Kind("thread", 1, "theirs"))  # the same by its judgement: it replaces the old
    assert table.get("thread").module == "theirs"
    with pytest.raises(ValueError) as info:
        table.add(Kind("process", 3))
    assert str(info.value) == (
        "session kind 'process' is already registered (by unknown "
        "module); pass override=True to replace it"
    )
    assert table.add(Kind("process", 3), override=True).size == 3
    assert table.names() == ["process", "thread"] == list(table)
    assert [k.name for k in table.entries()] == ["process", "thread"]
    assert "thread" in table and len(table) == 2
    with pytest.raises(LookupError) as missing:
        table.get("torch")
    assert missing.value.args == ("torch", ["process", "thread"])
    table.remove("thread")
    table.remove("thread")
    assert table.names() == ["process"]
    # without a judgement of its own, an entry is the same again only as the same object
    plain = Table("thing", lambda name, known: KeyError(name))
    entry = Kind("a", 1)
    plain.add(entry)
    plain.add(entry)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        plain.add(Kind("a", 1))
