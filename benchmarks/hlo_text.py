"""Reading a compiled HLO module's text (``compiled.as_text()``): its computations, what each instruction calls,
and every computation a set of them runs, and an estimate of the bytes each instruction moves. Used by
``decode_bytes`` (where a decode step's bytes go) and the TPU compile test (copies inside the decode loop)."""
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


# --------------------------------------------------------------------------------------------------
# Bytes per instruction (an estimate: each top-level op's operands read and result written)
# --------------------------------------------------------------------------------------------------
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
#: a layout's memory space other than the default (0: HBM on TPUs): S(1) is a TPU core's VMEM, others its SMEM and
#: semaphores; what lies there moves no HBM bytes
_ON_CHIP = re.compile(r"S\([1-9]\d*\)")
_OP = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z\-]+)\((.*?)\)(?:, |$)")
_SLICES = ("dynamic-slice", "slice", "gather")
_FREE = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple", "copy-start", "copy-done"}


def _shape_bytes(text: str, hbm_only: bool = False) -> int:
    """The bytes of the arrays a shape names (a tuple's summed); ``hbm_only``: of those whose layout puts them in
    HBM (no on-chip memory space)."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(text):
        if hbm_only and _ON_CHIP.search(layout):
            continue
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += _ITEM_BYTES[dtype] * count
    return total


def _ops(lines: list[str]) -> dict[str, dict]:
    out = {}
    for line in lines:
        match = _OP.match(line)
        if match:
            name, result, op, args = match.groups()
            out[name] = {"result": result, "op": op, "line": line,
                         "args": [a.strip().lstrip("%") for a in args.split(",") if a.strip().startswith("%")]}
    return out


def bytes_by_instruction(hlo_text: str) -> list[dict]:
    """Each top-level instruction of the ENTRY computation with the bytes it reads and writes: ``[{name, op,
    op_name, read, written}]``. Reads follow an operand into a fusion: an operand the fusion only slices counts
    its slices, one it only updates in place counts nothing; a result written in place by a dynamic-update-slice
    counts the update; a kernel that declares its cost (a Pallas call's ``cost_estimate``) counts the bytes it
    declares. Tuples, bitcasts and parameters are free. An estimate to find where bytes go, not the compiler's own
    count (``cost_analysis()``).

    ``hbm_read`` and ``hbm_written`` count only what lies in HBM: an operand or result the compiler placed in an
    on-chip memory space (a TPU's VMEM, ``S(1)`` in its layout) moves no HBM bytes, and an asynchronous copy
    (``copy-start``) that prefetches an HBM value on chip reads it there."""
    module = computations(hlo_text)
    entry = next(line.split()[1].lstrip("%") for line in hlo_text.splitlines() if line.startswith("ENTRY"))
    parsed = {name: _ops(lines) for name, lines in module.items()}

    def value_reads(comp, name, full):
        if "ROOT" in comp[name]["line"]:
            return full  # handed on whole (a bitcast fusion): its reader reads it all
        total = 0
        for user in (u for u in comp.values() if name in u["args"]):
            if user["op"] in _SLICES and user["args"][0] == name:
                total += _shape_bytes(user["result"])
            elif user["op"] == "dynamic-update-slice" and user["args"][0] == name:
                pass
            elif user["op"] == "bitcast":
                total += value_reads(comp, next(n for n, u in comp.items() if u is user), full)
            elif user["op"] == "fusion":
                total += sum(param_reads(called(user["line"])[0], i, full)
                             for i, arg in enumerate(user["args"]) if arg == name)
            else:
                return full
        return min(total, full)

    def param_reads(comp_name, index, full):
        comp = parsed.get(comp_name, {})
        name = next((n for n, op in comp.items()
                     if op["op"] == "parameter" and f"parameter({index})" in op["line"]), None)
        return full if name is None else value_reads(comp, name, full)

    ops, rows = parsed[entry], []

    def in_hbm(value: str) -> bool:
        return value not in ops or _shape_bytes(ops[value]["result"], hbm_only=True) > 0

    for name, op in ops.items():
        if op["op"] == "copy-start":  # (destination, source, context): moves HBM bytes only where one end is there
            source = _shape_bytes(ops[op["args"][0]]["result"]) if op["args"][0] in ops else 0
            destination = _ARRAY.search(op["result"])
            rows.append({"name": name, "op": op["op"], "op_name": "copy-start", "read": 0, "written": 0,
                         "hbm_read": source if in_hbm(op["args"][0]) else 0,
                         "hbm_written": _shape_bytes(destination.group(0), hbm_only=True) if destination else 0})
            continue
        if op["op"] in _FREE:
            continue
        fused = called(op["line"])[0] if op["op"] == "fusion" else None
        read = hbm_read = 0
        for i, arg in enumerate(op["args"]):
            full = _shape_bytes(ops[arg]["result"]) if arg in ops else 0
            if fused:
                part = param_reads(fused, i, full)
            elif not (op["op"] == "dynamic-update-slice" and i == 0):
                part = full
            else:
                part = 0
            read += part
            hbm_read += part if in_hbm(arg) else 0
        written, hbm_written = _shape_bytes(op["result"]), _shape_bytes(op["result"], hbm_only=True)
        declared = re.search(r'"cost_estimate":\{[^}]*"bytes_accessed":"(\d+)"', op["line"])
        if op["op"] == "custom-call" and declared:  # a Pallas kernel reads the blocks it says, not its operands whole
            read, written = hbm_read, hbm_written = int(declared.group(1)), 0
        root = next((o for o in parsed.get(fused, {}).values() if "ROOT" in o["line"]), None) if fused else op
        if root is not None and root["op"] == "dynamic-update-slice":
            scope = parsed[fused] if fused else ops
            if root["args"][1] in scope:
                written = _shape_bytes(scope[root["args"][1]]["result"])
                hbm_written = written if hbm_written else 0
        op_name = re.search(r'op_name="([^"]*)"', op["line"])
        rows.append({"name": name, "op": op["op"], "op_name": op_name.group(1) if op_name else "", "read": read,
                     "written": written, "hbm_read": hbm_read, "hbm_written": hbm_written})
    return rows
