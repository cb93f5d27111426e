"""Help text and documentation tables, made from the tables themselves.

What the planner knows (architectures, quantization formats), where workers can run (session
kinds) and which shard functions exist are each one table in the code; the CLI's help and the
tables of ``docs/`` are written from them here, so that neither lists them by hand. A test
checks that ``docs/`` holds what these functions write; after adding a row, regenerate with::

    python -m shardload.frontdoor.tables docs

Each generated table sits in its document between ``<!-- table: NAME -->`` and
``<!-- end of table -->``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable

__all__ = [
    "TABLES",
    "architectures_markdown",
    "formats_markdown",
    "planner_help",
    "render",
    "sessions_markdown",
    "shard_functions_markdown",
    "write_docs",
]


def _names(table: dict) -> str:
    return ", ".join(table)


def planner_help() -> str:
    """What ``shardload plan --help`` says the planner knows."""
    from ..formats import list_formats
    from ..planners.architectures import architecture_tables

    tables = architecture_tables()
    formats = "; ".join(f"{f.name}: {f.description}" for f in list_formats() if f.description)
    return (
        f"Architectures known (HF model_type): {_names(tables['hf'])}. "
        f"GGUF (general.architecture): {_names(tables['gguf'])}. "
        f"MLC (model_type): {_names(tables['mlc'])}.\n\n"
        f"Formats: {formats}."
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _note(kind: str, arch) -> str:
    if kind == "mlc":
        return "Llama's rules, from the tensor names"
    return arch.note or "as Llama"


def architectures_markdown() -> str:
    """The architectures the planner knows, one table per kind of checkpoint."""
    from ..planners.architectures import architecture_tables

    out = []
    titles = {
        "hf": "Hugging Face (`model_type`)",
        "gguf": "GGUF (`general.architecture`)",
        "mlc": "MLC (`model_type`)",
    }
    for kind, table in architecture_tables().items():
        out += [
            f"**{titles[kind]}**",
            "",
            "| architecture | what differs from Llama |",
            "|---|---|",
        ]
        out += [f"| `{name}` | {_cell(_note(kind, arch))} |" for name, arch in table.items()]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def formats_markdown() -> str:
    """The quantization formats, with the configs each reads."""
    from ..formats import list_formats

    rows = ["| format | what | recognised by (`quant_method`, or family/format) |", "|---|---|---|"]
    for fmt in list_formats():
        configs = ", ".join(f"`{key}`" for key in fmt.configs) or fmt.recognised_by
        rows.append(f"| `{fmt.name}` | {_cell(fmt.description)} | {configs} |")
    return "\n".join(rows) + "\n"


def sessions_markdown() -> str:
    """The kinds of session ``--session`` and ``open_session`` take."""
    from ..sessions.kinds import session_kinds

    rows = ["| `--session` | where the workers run |", "|---|---|"]
    rows += [f"| `{k.name}` | {_cell(k.description)} |" for k in session_kinds()]
    return "\n".join(rows) + "\n"


def shard_functions_markdown() -> str:
    """The built-in shard functions."""
    from ..registry import list_shard_funcs

    rows = ["| function | args | what it does |", "|---|---|---|"]
    rows += [
        f"| `{f.name}` | {f.arity_text()} | {_cell(f.doc.replace('``', '`'))} |"
        for f in list_shard_funcs()
        if f.module.startswith("shardload.")
    ]
    return "\n".join(rows) + "\n"


#: table name -> (the document it is in, its writer)
TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "architectures": ("planner.md", architectures_markdown),
    "formats": ("quant_formats.md", formats_markdown),
    "sessions": ("python.md", sessions_markdown),
    "shard-functions": ("plans.md", shard_functions_markdown),
}

_BLOCK = re.compile(
    r"(<!-- table: (?P<name>[a-z-]+) -->\n)(?P<body>.*?)(<!-- end of table -->)", re.S
)


def render(text: str) -> str:
    """``text`` with every generated table it holds written anew."""

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise KeyError(f"unknown generated table {name!r}; the tables are {', '.join(TABLES)}")
        return f"{match.group(1)}{TABLES[name][1]()}{match.group(4)}"

    return _BLOCK.sub(fill, text)


def write_docs(folder: str) -> list[str]:
    """Regenerate the tables of the documents in ``folder``; the files that changed."""
    changed = []
    for document in sorted({doc for doc, _ in TABLES.values()}):
        path = os.path.join(folder, document)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text)
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            changed.append(path)
    return changed


if __name__ == "__main__":  # pragma: no cover
    for path in write_docs(sys.argv[1] if len(sys.argv) > 1 else "docs"):
        print(f"rewrote {path}")
