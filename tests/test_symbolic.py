"""The num_shards expression evaluator: what it computes and what it refuses."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardload.symbolic import ExpressionError, check_expression, evaluate


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("num_shards", 4, 4),
        ("4096 // num_shards", 8, 512),
        ("3 * (128 // num_shards)", 4, 96),
        ("64 // min(num_shards, 2)", 1, 64),
        ("64 // min(num_shards, 2)", 8, 32),
        ("max(num_shards, 3) - 1", 2, 2),
        ("-(-9 // num_shards)", 4, 3),  # ceil division, for padded shapes
        ("num_shards % 3 + 7", 5, 9),
        ("  12  ", 1, 12),
    ],
)
def test_evaluates(text, n, expected):
    assert evaluate(text, n) == expected


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",  # calls, attributes, strings
        "num_shards ** 64",  # power: a cheap way to a huge number
        "num_shards / 2",  # true division gives floats
        "1.5",
        "True",
        "None",
        "x",
        "num_shards.bit_length()",
        "[1, 2]",
        "lambda: 1",
        "min(num_shards)",
        "min(a=1, b=2)",
        "abs(-1)",
        "",
        "   ",
        "1 +",
        "(1",
        "9" * 300,  # longer than the limit
        "99999999999999999999 * 99999999999999999999",  # out of int64
        "1 << 70",
        "num_shards if 1 else 2",
        "1 < 2",
    ],
)
def test_refuses(text):
    with pytest.raises(ExpressionError):
        evaluate(text, 4)


def test_division_by_zero_names_num_shards():
    with pytest.raises(ExpressionError, match="division by zero with num_shards=0"):
        evaluate("8 // num_shards", 0)


def test_check_needs_no_num_shards():
    check_expression("4096 // num_shards")
    with pytest.raises(ExpressionError):
        check_expression("4096 // shards")


@given(a=st.integers(0, 10**6), b=st.integers(1, 10**4), n=st.integers(1, 64))
def test_matches_python_arithmetic(a, b, n):
    # Python's own integer arithmetic is the reference for the allowed operators.
    assert evaluate(f"{a} // {b} + num_shards * {b} - {a} % {b}", n) == a // b + n * b - a % b
    assert evaluate(f"min({a}, num_shards, {b}) + max({a}, {b})", n) == min(a, n, b) + max(a, b)
