"""The import graph of the package: one direction of flow, no loops (docs/architecture.md).

Every ``import`` statement in ``shardload/`` counts, including those inside functions (a lazy
import hides a loop from Python, not from the design); imports under ``if TYPE_CHECKING`` do
not (they are annotations). The graph is read from the source with ``ast``, so the test needs
nothing imported.
"""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shardload")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


MODULES = _modules()


def _targets(module: str, node: ast.AST) -> list[str]:
    package = module if MODULES[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        if not name.startswith("shardload"):
            continue
        while name not in MODULES and "." in name:
            name = name.rsplit(".", 1)[0]
        if name != module:
            out.append(name)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        graph[module] = {
            t
            for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only
            for t in _targets(module, node)
        }
    return graph


GRAPH = _graph()


def _reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_is_read():
    assert "shardload.sessions.base" in GRAPH["shardload.sessions.threaded"]
    assert "shardload.readplan" in GRAPH["shardload.loader"]
    # a positive control for the layer test: the loader does reach the sessions it drives
    assert "shardload.sessions.base" in _reaches("shardload.loader")
    # the packages' modules are read too, and both registries are built on the one table
    assert "shardload.plan.bound" in GRAPH["shardload.plan.parse"]
    assert "shardload.pieces.sharing" in GRAPH["shardload.pieces.load"]
    assert "shardload.table" in GRAPH["shardload.registry"]
    assert "shardload.table" in GRAPH["shardload.sessions.functions"]


def test_no_import_loops():
    loops = sorted(m for m in GRAPH if m in _reaches(m))
    assert not loops, f"modules on an import loop: {loops}"


# what a layer may never import (directly or through anything it imports)
FORBIDDEN = {
    # sessions host workers and move messages: nothing of plans, formats, shard functions or
    # loading
    "shardload.sessions": [
        "shardload.loader",
        "shardload.pieces",
        "shardload.plan",
        "shardload.readplan",
        "shardload.readers",
        "shardload.registry",
        "shardload.shard_functions",
        "shardload.planners",
        "shardload.cli",
        "shardload.formats",
        "shardload.geometry",
        "shardload.frontdoor",
        "shardload.hf",
    ],
    # sources give bytes by range (object storage): nothing of formats, plans or loading
    "shardload.sources": [
        "shardload.readers",
        "shardload.plan",
        "shardload.readplan",
        "shardload.loader",
        "shardload.pieces",
        "shardload.sessions",
        "shardload.registry",
        "shardload.planners",
        "shardload.formats",
        "shardload.frontdoor",
        "shardload.cli",
        "shardload.hf",
        "shardload.vllm",
    ],
    # readers know formats and bytes, nothing of sharding
    "shardload.readers": [
        "shardload.plan",
        "shardload.readplan",
        "shardload.loader",
        "shardload.pieces",
        "shardload.sessions",
        "shardload.registry",
        "shardload.planners",
        "shardload.cli",
    ],
    "shardload.plan": [
        "shardload.readplan",
        "shardload.loader",
        "shardload.pieces",
        "shardload.sessions",
        "shardload.planners",
        "shardload.cli",
    ],
    "shardload.readplan": [
        "shardload.loader",
        "shardload.pieces",
        "shardload.sessions",
        "shardload.planners",
        "shardload.cli",
    ],
    "shardload.pieces": [
        "shardload.loader",
        "shardload.plan",
        "shardload.planners",
        "shardload.cli",
    ],
    "shardload.loader": [
        "shardload.planners",
        "shardload.cli",
        "shardload.frontdoor",
        "shardload.hf",
    ],
    # the staged pipeline moves byte runs to a device: nothing of plans, functions or loading
    "shardload.staging": [
        "shardload.plan",
        "shardload.pieces",
        "shardload.loader",
        "shardload.registry",
        "shardload.planners",
        "shardload.cli",
        "shardload.hf",
    ],
    # shard functions are pure array code; the registry imports them, never the reverse
    "shardload.shard_functions": [
        "shardload.registry",
        "shardload.plan",
        "shardload.loader",
        "shardload.sessions",
        "shardload.cli",
    ],
    "shardload.registry": [
        "shardload.plan",
        "shardload.loader",
        "shardload.sessions",
        "shardload.readers",
        "shardload.cli",
    ],
    "shardload.planners": [
        "shardload.loader",
        "shardload.pieces",
        "shardload.sessions",
        "shardload.cli",
        "shardload.hf",
        "shardload.frontdoor",
    ],
    # a format is its config, its tensors' axes and its dequantization: nothing of plans,
    # planning, loading or sessions
    "shardload.formats": [
        "shardload.plan",
        "shardload.planners",
        "shardload.loader",
        "shardload.pieces",
        "shardload.readplan",
        "shardload.sessions",
        "shardload.hf",
        "shardload.cli",
        "shardload.frontdoor",
        "shardload.readers",
    ],
    # each worker's share of a model, read from a plan's record: never from the planner
    "shardload.geometry": [
        "shardload.planners",
        "shardload.loader",
        "shardload.sessions",
        "shardload.frontdoor",
        "shardload.hf",
        "shardload.cli",
    ],
    # the front door sits under every caller and over everything it calls
    "shardload.frontdoor": ["shardload.cli", "shardload.hf"],
}


def _in_cli(module: str) -> bool:
    """The command line: the ``shardload.cli`` package (a module per command) and ``python -m
    shardload``."""
    return module == "shardload.__main__" or module.split(".")[:2] == ["shardload", "cli"]


def test_only_the_integration_imports_transformers_and_only_the_cli_imports_it():
    # shardload.hf sits beside the CLI: nothing below reaches it, and transformers (the
    # optional hf extra) is imported there alone
    for module, path in MODULES.items():
        if module == "shardload.hf" or module.startswith("shardload.hf."):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        assert "import transformers" not in source and "from transformers" not in source, module
        if not _in_cli(module):  # the CLI, on top
            reached = [t for t in _reaches(module) if t.split(".")[:2] == ["shardload", "hf"]]
            assert not reached, (module, reached)


# an integration (shardload.hf, and the engines' load formats to come) is built on the public
# API, the front door and the plan's record of the model (geometry), never on the planner's
# internals, and asks nothing of the kind of session it is given (its collectives are the
# session's own: ctx.group)
INTEGRATIONS = ["shardload.hf", "shardload.vllm"]
# (read plans are data, staging a setting, dtypes names: what an engine's loader places bytes
# with; shardload.vllm turns each rank's read plan into full-shape stand-ins)
INTEGRATION_MAY_IMPORT = {
    "shardload",
    "shardload.frontdoor",
    "shardload.geometry",
    "shardload.formats",
    "shardload.loader",
    "shardload.readers",
    "shardload.sessions",
    "shardload.errors",
    "shardload.plan",
    "shardload.readplan",
    "shardload.staging",
    "shardload.dtypes",
    # what the workers of a process compute once (hf: replicated pieces)
    "shardload.shared_outputs",
    # a checkpoint in object storage, opened once for transformers'
    # tokenizer (hf.run_setup): the URL test and the fetched bytes
    "shardload.sources",
    "shardload.readers.objects",
}
SESSION_KINDS = ("ThreadedSession", "ProcessSession", "TorchDistributedSession")


def _integration_problems(package: str, direct: set, tree: ast.AST) -> list[str]:
    """What an integration module does that it must not: import beyond what it may, ask for
    a kind of session."""
    problems = [
        f"imports {t}"
        for t in sorted(direct)
        if not t.startswith(package) and t not in INTEGRATION_MAY_IMPORT
    ]
    problems += sorted(
        {
            f"names {node.id}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and node.id in SESSION_KINDS
        }
    )
    problems += sorted(
        {
            "asks session.spmd"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "spmd"
        }
    )
    return problems


@pytest.mark.parametrize("package", INTEGRATIONS)
def test_integrations_read_the_plan_not_the_planner(package):
    modules = [m for m in GRAPH if m == package or m.startswith(package + ".")]
    assert modules
    for module in modules:
        with open(MODULES[module], encoding="utf-8") as f:
            tree = ast.parse(f.read())
        assert not _integration_problems(package, GRAPH[module], tree), module


def test_the_integration_rules_catch_what_hf_did_before():
    # shardload.hf before its redesign: the planner's internals, a session's kind
    old = ast.parse(
        "from ..planners.llama import ROW\n"
        "kind = 'threads' if isinstance(s, ThreadedSession) or s.spmd else 'gloo'\n"
    )
    assert _integration_problems("shardload.hf", {"shardload.planners.llama"}, old) == [
        "imports shardload.planners.llama",
        "names ThreadedSession",
        "asks session.spmd",
    ]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_arrow_from_a_lower_layer_up(layer):
    for module in sorted(m for m in GRAPH if m == layer or m.startswith(layer + ".")):
        reached = _reaches(module)
        bad = sorted(
            t
            for t in reached
            for f in FORBIDDEN[layer]
            if (t == f or t.startswith(f + ".")) and not (t == layer or t.startswith(layer + "."))
        )
        assert not bad, f"{module} imports (directly or not) {bad}"


# small modules every layer may import (docs/architecture.md, "shared by all"): they import
# nothing of shardload but one another, so importing them puts no layer above another
SHARED = [
    "shardload.errors",
    "shardload.limits",
    "shardload.table",
    "shardload.files",
    "shardload.strict_json",
    "shardload.dtypes",
    "shardload.selection",
    "shardload.gc_pause",
    "shardload.shared_outputs",
]


@pytest.mark.parametrize("module", SHARED)
def test_shared_modules_reach_no_layer(module):
    assert module in GRAPH, module
    reached = sorted(t for t in _reaches(module) if t not in SHARED)
    assert not reached, f"{module} imports (directly or not) {reached}"


def test_only_the_cli_reaches_the_terminal_libraries():
    for module, path in MODULES.items():
        if _in_cli(module) or module == "shardload.loader":
            continue  # the loader's progress bar imports tqdm.auto lazily, only when asked
        with open(path, encoding="utf-8") as f:
            source = f.read()
        assert "import click" not in source and "from click" not in source, module


# the command line's own layers: the group and what commands share, then one module per
# command, which knows no other command (adding one touches its module and one registration)
CLI_PLUMBING = {
    "shardload.cli.app",
    "shardload.cli.codes",
    "shardload.cli.interrupts",
    "shardload.cli.options",
    "shardload.cli.tables",
}


def test_cli_commands_know_no_other_command():
    commands = {m for m in GRAPH if m.startswith("shardload.cli.") and m not in CLI_PLUMBING}
    assert {"shardload.cli.load", "shardload.cli.plan", "shardload.cli.run"} <= commands
    for module in sorted(commands):
        assert not GRAPH[module] & commands, module
    for module in sorted(CLI_PLUMBING):
        assert not _reaches(module) & commands, module


# planning, validating and building read plans import no torch (about 1.2 s of every
# `shardload validate`, `plan` and `inspect`): a module those reach at import time imports
# torch inside the functions that use it (tests/test_cli.py runs the commands themselves)
PLANNING = [
    "shardload.cli.validate",
    "shardload.cli.plan",
    "shardload.cli.inspect",
    "shardload.frontdoor.plans",
    "shardload.planners.decision",
    "shardload.readplan",
    "shardload.readers",
    "shardload.registry",
]


def _import_time_graph() -> dict[str, tuple[set[str], bool]]:
    """Each module's imports run when it is imported (not inside a function or under
    TYPE_CHECKING), and whether torch is one of them."""
    out = {}
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        todo, targets, torch = list(tree.body), set(), False
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo.extend(node.orelse)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(_targets(module, node))
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                torch |= any(n == "torch" or n.startswith("torch.") for n in names)
            todo.extend(ast.iter_child_nodes(node))
        out[module] = (targets, torch)
    return out


def test_planning_imports_no_torch():
    graph = _import_time_graph()
    assert graph["shardload.loader"][1]  # a positive control: the loader does import torch
    seen: set[str] = set()
    todo = list(PLANNING)
    while todo:
        module = todo.pop()
        # importing a module imports the packages above it first
        parents = [".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 1)]
        for nxt in [module, *parents, *graph[module][0]]:
            if nxt not in seen and nxt in graph:
                seen.add(nxt)
                todo.append(nxt)
    importing = sorted(m for m in seen if graph[m][1])
    assert not importing, f"modules the planning path imports that import torch: {importing}"


# ---- errors are read as data, never as text ------------------------------------------------

#: methods that read a text's contents (what a message-matching check calls)
TEXT_READS = {
    "split",
    "rsplit",
    "partition",
    "rpartition",
    "startswith",
    "endswith",
    "find",
    "rfind",
    "index",
    "count",
}


def _own_errors() -> set[str]:
    with open(os.path.join(PACKAGE, "errors.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {n.name for n in tree.body if isinstance(n, ast.ClassDef)}


OWN_ERRORS = _own_errors()


def _names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    found = node.elts if isinstance(node, ast.Tuple) else [node]
    return {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in found}


def _text_of(node: ast.AST, exc: str) -> bool:
    """Whether ``node`` is the text of the caught exception ``exc``: ``str(exc)``,
    ``exc.reason``, ``exc.args...``, ``f"{exc}"``."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("str", "repr"):
        return any(isinstance(a, ast.Name) and a.id == exc for a in node.args)
    if isinstance(node, (ast.Attribute, ast.Subscript)):
        base = node.value
        while isinstance(base, (ast.Attribute, ast.Subscript)):
            base = base.value
        return isinstance(base, ast.Name) and base.id == exc
    if isinstance(node, ast.JoinedStr):
        return any(
            isinstance(v, ast.FormattedValue)
            and isinstance(v.value, ast.Name)
            and v.value.id == exc
            for v in node.values
        )
    return False


def _error_text_matches(tree: ast.AST) -> list[str]:
    """Where a handler of one of shardload's own errors reads the error's message to decide
    something (splits it, searches it, compares it): the data should be on the error."""
    problems = []
    for handler in ast.walk(tree):
        if not (
            isinstance(handler, ast.ExceptHandler)
            and handler.name
            and _names(handler.type) & OWN_ERRORS
        ):
            continue
        exc = handler.name
        for node in ast.walk(handler):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in TEXT_READS
                and _text_of(node.func.value, exc)
            ):
                problems.append(f"line {node.lineno}: {node.func.attr} on {exc}'s text")
            elif isinstance(node, ast.Compare) and any(
                _text_of(side, exc) for side in [node.left, *node.comparators]
            ):
                problems.append(f"line {node.lineno}: compares {exc}'s text")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and getattr(node.func.value, "id", None) == "re"
                and any(_text_of(a, exc) for a in node.args)
            ):
                problems.append(f"line {node.lineno}: re.{node.func.attr} on {exc}'s text")
    return problems


def _type_name_of(node: ast.AST, exc: str) -> str | None:
    """``"__module__"`` for ``type(exc).__module__`` (likewise ``__name__``,
    ``__qualname__``), else None."""
    if (
        isinstance(node, ast.Attribute)
        and node.attr in ("__module__", "__name__", "__qualname__")
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "type"
        and any(isinstance(a, ast.Name) and a.id == exc for a in node.value.args)
    ):
        return node.attr
    return None


def _caught(tree: ast.AST):
    """``(name, scope)`` for each exception a handler binds and each function parameter
    annotated as an exception."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.name:
            yield node.name, node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if "Exception" in ast.unparse(arg.annotation or ast.Constant(None)):
                    yield arg.arg, node


def _library_type_names(tree: ast.AST) -> list[str]:
    """Where a caught exception's class is told by its module's name, or by its class's name
    compared or searched, rather than by ``isinstance`` on the class the library exports
    (naming the type in a message is fine)."""
    problems = []
    for exc, scope in _caught(tree):
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and _type_name_of(node, exc) == "__module__":
                problems.append(f"line {node.lineno}: type({exc}).__module__")
            elif isinstance(node, ast.Compare) and any(
                _type_name_of(side, exc) for side in [node.left, *node.comparators]
            ):
                problems.append(f"line {node.lineno}: compares type({exc})'s name")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in TEXT_READS
                and _type_name_of(node.func.value, exc) in ("__name__", "__qualname__")
            ):
                problems.append(f"line {node.lineno}: {node.func.attr} on type({exc})'s name")
    return sorted(set(problems))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_errors_are_read_as_data_not_text(module):
    with open(MODULES[module], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    assert not _error_text_matches(tree), module
    assert not _library_type_names(tree), module


def test_the_error_rules_catch_what_was_there_before():
    # vllm/padding.py parsed the planner's own message; sources/store.py told obstore's
    # errors by their module's name
    old = ast.parse(
        "try:\n    plan()\nexcept PlanError as exc:\n"
        "    reason = exc.reason.split('. N that work', 1)[0]\n"
        "try:\n    get()\nexcept (FormatError, StorageError) as e:\n"
        "    if 'no such' in str(e): pass\n"
        "def _error(exc: BaseException):\n    return type(exc).__module__.startswith('obs')\n"
    )
    assert _error_text_matches(old) == [
        "line 4: split on exc's text",
        "line 8: compares e's text",
    ]
    assert _library_type_names(old) == ["line 10: type(exc).__module__"]


# ---- object storage is one layer -------------------------------------------------------------

#: what of sources/ a reader may import: the interface its bytes are read through
SOURCES_INTERFACE = {"shardload.sources", "shardload.sources.bytesource", "shardload.sources.specs"}
#: the one reader that is a bridge: it lists a folder of objects and hands the readers its files
OBJECT_BRIDGE = "shardload.readers.objects"


def _reader_reaches_inside_sources(module: str, imported: set[str]) -> list[str]:
    if module == OBJECT_BRIDGE:
        return []
    return sorted(
        m
        for m in imported
        if (m == "shardload.sources" or m.startswith("shardload.sources."))
        and m not in SOURCES_INTERFACE
    )


@pytest.mark.parametrize(
    "module",
    sorted(m for m in GRAPH if m.startswith("shardload.readers") or m == "shardload.files"),
)
def test_readers_see_byte_sources_not_object_storage(module):
    # a reader reads bytes through a ByteSource; which store, client or object holds them is
    # the source layer's business (readers/objects.py opens a folder of objects for them)
    assert not _reader_reaches_inside_sources(module, GRAPH[module]), module


def test_the_reader_rule_catches_what_readers_did_before():
    # readers/safetensors.py fetched headers with the store's `each`, gguf.py knew ObjectBytes
    assert _reader_reaches_inside_sources(
        "shardload.readers.safetensors",
        {"shardload.sources.store", "shardload.sources.sparse", "shardload.sources.bytesource"},
    ) == ["shardload.sources.sparse", "shardload.sources.store"]
