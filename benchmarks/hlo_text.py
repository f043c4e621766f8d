"""Reading a compiled HLO module's text (``compiled.as_text()``): its computations, what each instruction calls,
and every computation a set of them runs. Used by the step profile (ops inside a conditional's branches) and the
TPU compile test (copies inside the decode loop)."""
from __future__ import annotations

import re

#: a computation's header (column 0), an instruction (indented; ROOT marks the result), and the attributes that
#: name the computations an instruction runs
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_CALLED = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
                     r"|branch_computations=\{([^}]*)\}")


def computations(hlo_text: str) -> dict[str, list[str]]:
    """{computation name: its instruction lines}."""
    out: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            match = _COMPUTATION.match(line)
            current = match.group(1) if match else None
            out[current] = []
        elif current is not None and INSTRUCTION.match(line):
            out[current].append(line)
    return out


def called(line: str) -> list[str]:
    """The computations an instruction line runs (fusions, loop bodies and conditions, branches, reducers)."""
    names = []
    for single, several in _CALLED.findall(line):
        names += [single] if single else [n.strip().lstrip("%") for n in several.split(",")]
    return names


def reachable(module: dict[str, list[str]], roots) -> set[str]:
    """The computations ``roots`` name, and every computation they run, transitively (``module``: from
    :func:`computations`)."""
    pending, seen = list(roots), set()
    while pending:
        name = pending.pop()
        if name in seen or name not in module:
            continue
        seen.add(name)
        for line in module[name]:
            pending += called(line)
    return seen
