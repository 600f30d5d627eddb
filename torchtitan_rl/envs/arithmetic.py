"""Safe arithmetic for environments that read expressions from a model: no `eval`.

`parse(text)` walks Python's AST and accepts only non-negative integer literals, the binary
operators + - * / and parentheses (which the AST absorbs); it computes with exact fractions
and bounds every intermediate value, so `9**9**9`, `__import__('os')`, `1/0`, names, calls,
attributes, unary minus, floats and huge literals are errors, never exceptions:

    parse("(3 + 5) * 2")   -> Parsed(value=Fraction(16), numbers=[3, 5, 2],
                                     steps=["3+5=8", "8*2=16"])
    parse("2 ** 100")      -> Invalid("operator Pow is not allowed")
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from fractions import Fraction

MAX_CHARS = 200
"""Longer expressions are refused before parsing."""
MAX_ABS = 10**12
"""Bound on every literal and intermediate value."""
OPERATORS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


@dataclass(frozen=True, slots=True)
class Parsed:
    value: Fraction
    numbers: list[int]
    """The integer literals, in order of appearance."""
    steps: list[str]
    """Each operation as it is computed, innermost first: "3*7=21", "21+12=33"."""


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: str


def parse(text: str, allowed: tuple[type, ...] = tuple(OPERATORS)) -> Parsed | Invalid:
    """The exact value of `text` and the numbers it uses, or why it is not accepted."""
    text = text.strip()
    if not text:
        return Invalid("empty expression")
    if len(text) > MAX_CHARS:
        return Invalid(f"longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        return Invalid(f"not an expression ({type(e).__name__})")
    numbers: list[int] = []
    steps: list[str] = []
    try:
        value = _walk(tree.body, numbers, steps, allowed)
    except _Refused as e:
        return Invalid(str(e))
    except RecursionError:
        return Invalid("nested too deeply")
    return Parsed(value=value, numbers=numbers, steps=steps)


class _Refused(Exception):
    pass


SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _walk(
    node: ast.AST, numbers: list[int], steps: list[str], allowed: tuple[type, ...]
) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if not 0 <= node.value <= MAX_ABS:
            raise _Refused(f"number {node.value} out of range")
        numbers.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in allowed:
        left = _walk(node.left, numbers, steps, allowed)
        right = _walk(node.right, numbers, steps, allowed)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _Refused("division by zero")
        value = OPERATORS[type(node.op)](left, right)
        if abs(value) > MAX_ABS:
            raise _Refused("value out of range")
        symbol = SYMBOLS[type(node.op)]
        steps.append(f"{_operand(left)}{symbol}{_operand(right)}={format_value(value)}")
        return value
    if isinstance(node, ast.BinOp):
        raise _Refused(f"operator {type(node.op).__name__} is not allowed")
    raise _Refused(f"{type(node).__name__} is not allowed")


def _operand(value: Fraction) -> str:
    """A step's operand, bracketed when it is a fraction or negative: "9/(3/11)=33"."""
    text = format_value(value)
    return text if value.denominator == 1 and value >= 0 else f"({text})"


def format_value(value: Fraction) -> str:
    """An integer as digits, a fraction as p/q."""
    return (
        str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    )
