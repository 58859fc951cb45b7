"""A calculator tool for the arithmetic task: the example multi-turn episode.

The model may write ``calc(<expression>)`` in its first turn; the tool evaluates it and its
answer is appended (masked out of the loss) with a cue for the final answer, which the model
then gives in a second turn. The episode returns its own reward: ``exact_match`` of the final
answer (the text after the tool's answer, or the first turn when no tool was called) against
the record's ``answer``, so copying the tool's result pays only when the call was right.

``start`` (an ``episode.kwargs`` entry, default ``"calc("``) is environment text that opens the
first turn, masked like any tool output: a tool-call prefill. SmolLM2-135M never writes
``calc(`` by itself, even told about the tool in a system prompt; opened with it, it writes an
expression in 45 of 48 samples and the right one in 21. ``start=""`` leaves the choice of
calling the tool to the model.

Use it with ``--episode.fn pipeline.tasks.calculator:episode`` on ``--data arithmetic:N``.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from pipeline.tasks.rewards import exact_match

CALL = re.compile(r"calc\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
"""``calc(...)`` with at most one level of nested parentheses inside."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_ABS = 10**12


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // %, parentheses) without ``eval``;
    ValueError for anything else or a result beyond 1e12."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        value = ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError, TypeError) as e:
        raise ValueError(str(e)) from None
    if abs(value) > _MAX_ABS:
        raise ValueError("result too large")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator(expression: str) -> str:
    """The tool as the model sees it: the value, or ``error: ...`` for a bad expression (the
    model's mistake, answered like any tool answer, not a failure of the episode)."""
    try:
        return calc(expression)
    except ValueError as e:
        return f"error: {e}"


async def episode(
    ctx: Any, prompt: Any, answer: str | None = None, start: str = "calc(", **meta: Any
) -> float:
    """Turn 1 (may call the calculator), the tool's answer, turn 2 (the final answer)."""
    first = await ctx.generate(start or None)
    call = CALL.search(start + first.text)
    if call is None:
        return exact_match(prompt, first.text, answer)
    result = await ctx.tool(calculator, call.group(1))
    final = await ctx.generate(f"\nresult: {result}\nanswer: ")
    return exact_match(prompt, final.text, answer)
