"""Integer expressions of ``num_shards`` in plans: one plan file for every N.

A shape entry or extra argument may be a string such as ``"4096 // num_shards"``. It is parsed
with ``ast`` and evaluated by walking the tree; nothing is ever passed to ``eval``. Allowed:
integer literals, the name ``num_shards``, ``+ - * // %``, unary ``-``, parentheses, and the
functions ``min(a, b, ...)`` and ``max(a, b, ...)`` (GQA plans need ``min(num_shards, n_kv)``).

Plans repeat the same few expressions thousands of times, so an expression is parsed once:
``compile`` turns it into a small evaluator, cached by text (``functools.lru_cache``). Every
value along the way must stay within int64.

>>> evaluate("3 * (128 // num_shards)", 4)
96
>>> evaluate("64 // min(num_shards, 2)", 8)
32
>>> compile("num_shards * 2")(3)
6
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from collections.abc import Callable

from .errors import quote

__all__ = ["MAX_LENGTH", "NAME", "ExpressionError", "check_expression", "compile", "evaluate"]

NAME = "num_shards"
MAX_LENGTH = 256
# Results beyond int64 cannot be shapes or arguments of anything we allocate.
_LIMIT = 2**63 - 1

BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
FUNCS = {"min": min, "max": max}
# Cheap pre-filter: anything outside this alphabet is refused before ast sees it.
ALPHABET = re.compile(r"^[0-9A-Za-z_ +\-*/%(),]*$")

Evaluator = Callable[[int], int]


class ExpressionError(ValueError):
    """An expression is malformed or uses something outside the allowed grammar."""


def check_expression(text: str) -> None:
    """Raise ``ExpressionError`` unless ``text`` is a well-formed expression (N not needed)."""
    compile(text)


def evaluate(text: str, num_shards: int) -> int:
    """Value of the expression ``text`` for ``num_shards``."""
    return compile(text)(num_shards)


def compile(text: str) -> Evaluator:
    """``f(num_shards) -> int`` for the expression ``text``; ``ExpressionError`` if malformed.

    Cached by text: a plan's thousands of ``"4096 // num_shards"`` are parsed once.
    """
    if not isinstance(text, str):
        raise ExpressionError(f"expression must be a string, got {quote(text)}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(
            f"expression of {len(text)} characters is longer than the {MAX_LENGTH}-character limit"
        )
    return _compile(text)


@functools.lru_cache(maxsize=4096)
def _compile(text: str) -> Evaluator:
    if not text.strip() or not ALPHABET.match(text):
        raise ExpressionError(f"{quote(text)} is not an integer expression of {NAME}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ExpressionError(f"{text!r} is not a valid expression") from None
    return _build(tree.body, text)


def _checked(value: int, text: str, n: int) -> int:
    if abs(value) > _LIMIT:
        raise ExpressionError(f"{text!r}: value out of the int64 range with {NAME}={n}")
    return value


def _build(node: ast.AST, text: str) -> Evaluator:
    """Check ``node`` against the grammar and return its evaluator."""
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) is not int:
            raise ExpressionError(f"{text!r}: only integer literals are allowed")
        if abs(value) > _LIMIT:  # refused when evaluated: the grammar (and the schema) allow it
            return lambda n: _checked(value, text, n)
        return lambda n: value
    if isinstance(node, ast.Name):
        if node.id != NAME:
            raise ExpressionError(f"{text!r}: unknown name {node.id!r}; the only name is {NAME!r}")
        return lambda n: n
    if isinstance(node, ast.BinOp):
        if type(node.op) not in BINOPS:
            raise ExpressionError(f"{text!r}: only + - * // % are allowed")
        op = BINOPS[type(node.op)]
        left, right = _build(node.left, text), _build(node.right, text)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)):

            def divide(n: int) -> int:
                a, b = left(n), right(n)
                if b == 0:
                    raise ExpressionError(f"{text!r}: division by zero with {NAME}={n}")
                return _checked(op(a, b), text, n)

            return divide
        return lambda n: _checked(op(left(n), right(n)), text, n)
    if isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub):
            raise ExpressionError(f"{text!r}: only unary minus is allowed")
        operand = _build(node.operand, text)
        return lambda n: _checked(-operand(n), text, n)
    if isinstance(node, ast.Call):
        if (
            not isinstance(node.func, ast.Name)
            or node.func.id not in FUNCS
            or node.keywords
            or len(node.args) < 2
        ):
            raise ExpressionError(f"{text!r}: the only calls are min(a, b, ...) and max(a, b, ...)")
        func = FUNCS[node.func.id]
        args = [_build(a, text) for a in node.args]
        return lambda n: func(a(n) for a in args)
    raise ExpressionError(f"{text!r}: {type(node).__name__} is not allowed")
