"""Integer expressions of ``num_shards`` in plans: one plan file for every N.

A shape entry or extra argument may be a string such as ``"4096 // num_shards"``. It is parsed
with ``ast`` and evaluated by walking the tree; nothing is ever passed to ``eval``. Allowed:
integer literals, the name ``num_shards``, ``+ - * // %``, unary ``-``, parentheses, and the
functions ``min(a, b, ...)`` and ``max(a, b, ...)`` (GQA plans need ``min(num_shards, n_kv)``).

>>> evaluate("3 * (128 // num_shards)", 4)
96
>>> evaluate("64 // min(num_shards, 2)", 8)
32
"""

from __future__ import annotations

import ast
import operator
import re

__all__ = ["evaluate", "check_expression", "ExpressionError", "NAME", "MAX_LENGTH"]

NAME = "num_shards"
MAX_LENGTH = 256
# Results beyond int64 cannot be shapes or arguments of anything we allocate.
_LIMIT = 2**63 - 1

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_FUNCS = {"min": min, "max": max}
# Cheap pre-filter: anything outside this alphabet is refused before ast sees it.
_ALPHABET = re.compile(r"^[0-9A-Za-z_ +\-*/%(),]*$")


class ExpressionError(ValueError):
    """An expression is malformed or uses something outside the allowed grammar."""


def check_expression(text: str) -> None:
    """Raise ``ExpressionError`` unless ``text`` is a well-formed expression (N not needed)."""
    _parse(text)


def evaluate(text: str, num_shards: int) -> int:
    """Value of the expression ``text`` for ``num_shards``."""
    return _eval(_parse(text), num_shards, text)


def _parse(text: str) -> ast.expr:
    if not isinstance(text, str):
        raise ExpressionError(f"expression must be a string, got {text!r}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    if not text.strip() or not _ALPHABET.match(text):
        raise ExpressionError(f"{text!r} is not an integer expression of {NAME}")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ExpressionError(f"{text!r} is not a valid expression") from None
    _check(tree.body, text)
    return tree.body


def _check(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise ExpressionError(f"{text!r}: only integer literals are allowed")
    elif isinstance(node, ast.Name):
        if node.id != NAME:
            raise ExpressionError(f"{text!r}: unknown name {node.id!r}; the only name is {NAME!r}")
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise ExpressionError(f"{text!r}: only + - * // % are allowed")
        _check(node.left, text)
        _check(node.right, text)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, ast.USub):
            raise ExpressionError(f"{text!r}: only unary minus is allowed")
        _check(node.operand, text)
    elif isinstance(node, ast.Call):
        if (not isinstance(node.func, ast.Name) or node.func.id not in _FUNCS
                or node.keywords or len(node.args) < 2):
            raise ExpressionError(f"{text!r}: the only calls are min(a, b, ...) and max(a, b, ...)")
        for arg in node.args:
            _check(arg, text)
    else:
        raise ExpressionError(f"{text!r}: {type(node).__name__} is not allowed")


def _eval(node: ast.expr, n: int, text: str) -> int:
    if isinstance(node, ast.Constant):
        value = node.value
    elif isinstance(node, ast.Name):
        value = n
    elif isinstance(node, ast.UnaryOp):
        value = -_eval(node.operand, n, text)
    elif isinstance(node, ast.Call):
        value = _FUNCS[node.func.id](_eval(a, n, text) for a in node.args)
    else:
        left, right = _eval(node.left, n, text), _eval(node.right, n, text)
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise ExpressionError(f"{text!r}: division by zero with {NAME}={n}")
        value = _BINOPS[type(node.op)](left, right)
    if abs(value) > _LIMIT:
        raise ExpressionError(f"{text!r}: value out of the int64 range with {NAME}={n}")
    return value
