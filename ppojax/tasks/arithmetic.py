"""A seeded generator of arithmetic word problems in GSM8K's format: a math task that needs no download.

Each record is ``{"prompt": question + instruction, "question": ..., "answer": "<working>\\n#### <n>"}``,
the answer column as GSM8K writes it (``ppojax.tasks.math_answers.reference_answer`` reads the number after
``####``). Problems come from a handful of templates (adding, taking away, equal groups, and two steps of
adding then taking away); ``max_number`` bounds the operands. The same seed gives the same problems;
``write_splits`` writes a train and a test file whose questions do not overlap.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from ppojax.io.strict_json import write_text_atomic

__all__ = ["INSTRUCTION", "KINDS", "problem", "problems", "write_splits"]

INSTRUCTION = "Give the final answer as a number after '####'."
KINDS = ("add", "take_away", "groups", "two_steps")

_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Zoe", "Max", "Ella")
_ITEMS = ("apples", "marbles", "books", "stickers", "coins", "cards", "pens", "shells", "cookies", "stamps")


def problem(rng: random.Random, kind: str, max_number: int) -> dict:
    """One problem of ``kind`` (one of ``KINDS``) with operands up to ``max_number`` -> a record."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if kind == "add":
        a, b = rng.randint(2, max_number), rng.randint(2, max_number)
        question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
        working, result = f"{a} + {b} = {a + b}", a + b
    elif kind == "take_away":
        b, c = rng.randint(2, max_number), rng.randint(1, max_number)
        a = b + c
        question = f"{name} has {a} {item}. {name} gives {b} {item} away. How many {item} does {name} have left?"
        working, result = f"{a} - {b} = {c}", c
    elif kind == "groups":
        a, b = rng.randint(2, min(9, max_number)), rng.randint(2, min(12, max_number))
        question = f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have in all?"
        working, result = f"{a} * {b} = {a * b}", a * b
    elif kind == "two_steps":
        a, b = rng.randint(2, max_number), rng.randint(2, max_number)
        c = rng.randint(1, a + b - 1)
        question = (f"{name} has {a} {item}. {name} gets {b} more {item} and then gives {c} {item} away. "
                    f"How many {item} does {name} have now?")
        working, result = f"{a} + {b} = {a + b}\n{a + b} - {c} = {a + b - c}", a + b - c
    else:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    return {"prompt": f"{question} {INSTRUCTION}", "question": question, "answer": f"{working}\n#### {result}",
            "kind": kind}


def problems(seed: int, count: int, *, kinds=KINDS, max_number: int = 20) -> Iterator[dict]:
    """``count`` problems, kinds drawn uniformly from ``kinds``; the same seed gives the same problems."""
    rng = random.Random(seed)
    for _ in range(count):
        yield problem(rng, rng.choice(list(kinds)), max_number)


def write_splits(directory, *, seed: int = 0, train: int = 2000, test: int = 200, kinds=KINDS,
                 max_number: int = 20) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` into ``directory`` (test questions never appear in train) ->
    their paths. Each file is written whole to a temporary name, then renamed: never half-written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    seen, splits = set(), {"test": [], "train": []}
    stream = problems(seed, 50 * (train + test), kinds=kinds, max_number=max_number)
    for split, size in (("test", test), ("train", train)):
        for record in stream:
            if len(splits[split]) == size:
                break
            if record["question"] not in seen:
                seen.add(record["question"])
                splits[split].append(record)
        if len(splits[split]) < size:
            raise ValueError(f"only {len(seen)} distinct problems of kinds {list(kinds)} up to {max_number}; ask "
                             "for fewer or raise max_number")
    paths = []
    for split in ("train", "test"):
        path = directory / f"{split}.jsonl"
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in splits[split]))
        paths.append(path)
    return paths[0], paths[1]
