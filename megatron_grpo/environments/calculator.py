"""A safe calculator tool, and the environment that serves it (``env.name=
megatron_grpo.environments.calculator:Calculator``).

The model calls the tool by writing ``<calc>EXPRESSION</calc>`` (``env.stop`` ends its turn
at ``</calc>``); the environment answers ``<result>VALUE</result>`` and the model goes on.
A turn without a call is the model's answer: the episode ends, scored 1.0 when its last
number equals the row's ``answer``, else 0.0. Expressions are parsed by ``ast`` (numbers,
``+ - * / // % **`` and parentheses; no names, calls or attributes), never ``eval``'d, with
bounds on their size and on the numbers they make."""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_MAX_CHARS = 200
_MAX_DIGITS = 60
_MAX_EXPONENT = 64


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its numbers grow past the bounds."""


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (``CalculatorError`` for anything else)."""
    if len(expression) > _MAX_CHARS:
        raise CalculatorError(f"expression over {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        if isinstance(node.value, bool):
            raise CalculatorError("True / False are not numbers here")
        return _bounded(Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _value(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (b.denominator != 1 or abs(b) > _MAX_EXPONENT):
            raise CalculatorError(f"exponent {b} is not an integer up to {_MAX_EXPONENT}")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow) and a == 0 and b < 0:
            raise CalculatorError("division by zero")
        return _bounded(Fraction(_OPS[type(node.op)](a, b)))
    raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def _bounded(v: Fraction) -> Fraction:
    if len(str(abs(v.numerator))) > _MAX_DIGITS or len(str(v.denominator)) > _MAX_DIGITS:
        raise CalculatorError(f"a number over {_MAX_DIGITS} digits")
    return v


def format_value(v: Fraction) -> str:
    """An integer as itself, anything else as a decimal of up to 6 places."""
    if v.denominator == 1:
        return str(v.numerator)
    return f"{float(v):.6f}".rstrip("0").rstrip(".")


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_answer(answer: str) -> str:
    """The number an answer ends with: GSM8K's ``... #### 1,234`` gives ``1234``; a plain
    answer is itself, stripped."""
    tail = answer.rsplit("####", 1)[-1].strip()
    return tail.replace(",", "")


class Calculator:
    """The calculator environment: tool calls in ``OPEN ... CLOSE``, results in
    ``RESULT_OPEN ... RESULT_CLOSE``; a turn without a call is the answer (see the module
    docstring). Subclass it to change the markers (the tiny tool task does)."""

    OPEN, CLOSE = "<calc>", "</calc>"
    RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

    def __init__(self, row: dict[str, Any]) -> None:
        self.answer = final_answer(str(row["answer"]))

    def step(self, text: str) -> tuple[str | None, float | None]:
        call = self._call(text)
        if call is None:
            return None, self.score(text)
        try:
            result = format_value(evaluate(call))
        except CalculatorError as e:
            result = f"error: {e}"
        return f"{self.RESULT_OPEN}{result}{self.RESULT_CLOSE}", None

    def _call(self, text: str) -> str | None:
        """The expression of the turn's last tool call, when the turn ends with one."""
        stripped = text.rstrip()
        if not stripped.endswith(self.CLOSE):
            return None
        body = stripped[: -len(self.CLOSE)]
        at = body.rfind(self.OPEN)
        return None if at < 0 else body[at + len(self.OPEN) :]

    def score(self, text: str) -> float:
        """1.0 when the turn's last number is the answer."""
        numbers = _NUMBER.findall(text.replace(",", ""))
        return float(bool(numbers) and numbers[-1] == self.answer)


class TinyCalculator(Calculator):
    """The calculator with one-character markers, which a 2-layer character-level model
    picks up in a short warm start: ``<123+456>`` calls the tool, ``=579;`` is its answer
    (``configs/tiny_tools_cpu.yaml``, the ``synthetic:sum`` task)."""

    OPEN, CLOSE = "<", ">"
    RESULT_OPEN, RESULT_CLOSE = "=", ";"
