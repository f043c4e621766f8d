"""Guess the number: a multi-turn game with feedback, offline (configs/guess_number_grpo.yaml).

The environment (``GuessNumber``, ppojax's ``Environment`` protocol) holds a secret number from the dataset row's
``target`` column; each model turn is a guess (the first whole number in the message), answered "Higher." or
"Lower."; the episode ends when the guess is right or after the run's turns. The reward, read once at the end
(``get_reward``): 1 for a solved game; otherwise partial credit for the closest guess, ``0.5 * (1 - distance /
(HIGH - LOW))``, and 0 without any guess (a 135M model rarely solves a game at first: the credit lets it learn to
guess, then to follow the feedback). A game is solved exactly when its reward is 1. ``records`` generates the
prompts, seeded.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterator, Optional

from ppojax.agents import Environment, Step
from ppojax.io.strict_json import write_text_atomic

__all__ = ["GuessNumber", "records", "write_splits", "LOW", "HIGH", "PROMPT"]

LOW, HIGH = 1, 16
PROMPT = (f"Guess my secret number between {LOW} and {HIGH}. After a wrong guess I say if my number is higher or "
          "lower. Reply with only your guess, for example: 8")
_NUMBER = re.compile(r"-?\d+")


def records(seed: int, count: int) -> Iterator[dict]:
    """``count`` games: ``{"prompt": ..., "target": n}`` with n uniform in [LOW, HIGH]."""
    rng = random.Random(seed)
    for _ in range(count):
        yield {"prompt": PROMPT, "target": rng.randint(LOW, HIGH)}


def write_splits(directory, *, seed: int = 0, train: int = 2000, test: int = 200) -> tuple[Path, Path]:
    """``train.jsonl`` and ``test.jsonl`` in ``directory`` (seeds ``seed`` and ``seed + 1``), each written whole to
    a temporary name, then renamed -> their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, count, split_seed in (("train", train, seed), ("test", test, seed + 1)):
        path = directory / f"{split}.jsonl"
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in records(split_seed, count)))
        paths.append(path)
    return paths[0], paths[1]


class GuessNumber(Environment):
    """One game (module docstring)."""

    def reset(self, target: int, **row) -> Optional[str]:
        self.target, self.closest = int(target), None
        return None

    def step(self, action: str) -> Step:
        found = _NUMBER.search(action)
        if found is None:
            return Step("Reply with only a number.", None, False)
        guess = int(found.group())
        if self.closest is None or abs(guess - self.target) < abs(self.closest - self.target):
            self.closest = guess
        if guess == self.target:
            return Step(None, None, True)
        return Step("Higher." if guess < self.target else "Lower.", None, False)

    def get_reward(self) -> float:
        if self.closest is None:
            return 0.0
        if self.closest == self.target:
            return 1.0
        return 0.5 * max(0.0, 1.0 - abs(self.closest - self.target) / (HIGH - LOW))
