"""A calculator tool for the arithmetic task (configs/math_tools_grpo.yaml): the model may call it to work a
problem out instead of computing in its head.

``calculate`` evaluates one arithmetic expression of numbers, ``+ - * /``, parentheses and unary minus, parsed
with Python's ``ast`` (no names, calls or attributes: nothing but arithmetic runs). A bad expression raises, and
the model gets the error as the tool's answer (ppojax.agents.tools).
"""
from __future__ import annotations

import ast
import operator

__all__ = ["calculate"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_DIGITS = 30


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        result = _BINARY[type(node.op)](_value(node.left), _value(node.right))
        if len(str(int(abs(result)))) > _MAX_DIGITS:
            raise ValueError("the result is too large")
        return result
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r} (use numbers, + - * / and parentheses)")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression to evaluate, with numbers, +, -, *, / and parentheses, e.g. "12 * 3 - 4".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from err
    result = _value(tree.body)
    if isinstance(result, float) and result.is_integer():
        result = int(result)
    return str(result)
