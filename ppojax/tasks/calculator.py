"""A calculator tool for the arithmetic task (configs/math_tools_grpo.yaml): the model may call it to work a
problem out instead of computing in its head.

``calculate`` evaluates one arithmetic expression of numbers, ``+ - * /``, parentheses and unary minus, parsed
with Python's ``ast`` (no names, calls or attributes: nothing but arithmetic runs). A bad expression raises, and
the model gets the error as the tool's answer (ppojax.agents.tools).

``demonstration`` writes the conversation a tool user would have on an arithmetic record (a call with the
problem's expression, the result, the final answer), which ``ppojax.agents.demonstrations.episode_stream`` lays
out for a warm start (``examples/calculator_warm_start.py``).

``with_tool_examples`` turns an arithmetic record's prompt into a conversation that opens with two worked problems,
each answered by a call to ``calculate``, its result and the final ``#### <n>`` (the built-in dataset
``arithmetic_tools``): a model too small to call a tool it has only seen described may copy one it has seen used.
"""
from __future__ import annotations

import ast
import operator

__all__ = ["TOOL_EXAMPLES", "calculate", "demonstration", "working_expression", "with_tool_examples"]

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


#: (question, expression, answer's wording with {result}) of the worked problems ``with_tool_examples`` opens with
TOOL_EXAMPLES = (
    ("Kim has 14 pens. Kim gets 9 more pens. How many pens does Kim have now?", "14 + 9",
     "Kim has 14 + 9 = {result} pens."),
    ("Joe has 6 boxes with 7 cups in each box. How many cups does Joe have in all?", "6 * 7",
     "Joe has 6 * 7 = {result} cups."),
)


def with_tool_examples(record: dict, instruction: str) -> dict:
    """``record`` (``ppojax.tasks.arithmetic``'s: its prompt a question + ``instruction``) with the prompt as a
    conversation: each of ``TOOL_EXAMPLES`` as user -> assistant calling ``calculate`` -> the tool's answer ->
    assistant's final answer, then the record's own question as the last user message."""
    messages = []
    for question, expression, wording in TOOL_EXAMPLES:
        result = calculate(expression)
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        messages += [{"role": "user", "content": f"{question} {instruction}"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": result},
                     {"role": "assistant", "content": wording.format(result=result) + f"\n#### {result}"}]
    return dict(record, prompt=messages + [{"role": "user", "content": record["prompt"]}])


def working_expression(answer: str) -> str:
    """The one expression of an arithmetic record's working (``"6 + 15 = 21\\n21 - 6 = 15\\n#### 15"`` ->
    ``"6 + 15 - 6"``): each later line's operation applied to the running result."""
    lines = answer.split("\n")[:-1]
    expression = lines[0].split(" = ")[0]
    for line in lines[1:]:
        _, op, operand = line.split(" = ")[0].split(" ")
        expression = f"{expression} {op} {operand}"
    return expression


def demonstration(record: dict) -> list:
    """The conversation of a model that calls ``calculate`` on an arithmetic record (chat messages, the call as a
    structured tool call): the prompt, the call, the tool's result, the final answer."""
    expression = working_expression(record["answer"])
    result = calculate(expression)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return [{"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"{expression} = {result}\n#### {result}"}]
