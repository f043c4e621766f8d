"""Calling Python reward functions the way TRL's GRPOTrainer calls them, concurrently, on the host.

A reward function is called with keyword arguments: ``prompts`` (the rendered prompt texts), ``completions``
(texts), ``completion_ids`` (token ids, stop token and padding removed) and every dataset column of the rows by
its column name; it receives those its signature names (all of them when it takes ``**kwargs``). It returns one
float per row, or None where it does not apply. Two other shapes are recognised from the signature:

    per-sample   ``f(prompt, completion, **row)``: singular names, called once per row with that row's values.
    positional   ``f(prompts, completions)`` under other parameter names (ppojax's older convention): the
                 prompts and completions are passed by position.

``async def`` functions are awaited on the process's one event loop (``ppojax.host``, shared with tools and
environments; a per-sample async function has its rows awaited together); synchronous functions run on a thread
pool, so the functions of one batch run at the same time and a slow one costs its own time, not the sum.
:class:`RewardCall` is one function with its calling convention, worked out once when the run is built
(:meth:`RewardCall.check_arguments` refuses a function that needs a column the dataset lacks, before any compute).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ppojax.errors import RewardFunctionError
from ppojax.host import event_loop

__all__ = ["RewardBatch", "RewardCall", "call_all", "reward_function_name"]

STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids")
_SINGULAR = {"prompts": "prompt", "completions": "completion", "completion_ids": "completion_ids"}


def reward_function_name(fn) -> str:
    """A readable name for errors and metric names: ``module.qualname``, or the repr for other callables."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:  # a callable object, or a functools.partial
        inner = getattr(fn, "func", None)
        if inner is not None:
            return f"partial({reward_function_name(inner)})"
        return type(fn).__qualname__ + " instance"
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


@dataclass
class RewardBatch:
    """The rows one reward call scores (B of them).

    prompts: B prompt texts; completions: B completion texts; completion_ids: B lists of token ids;
    columns: {dataset column: B values} (empty when the rows' dataset columns are unknown).
    """

    prompts: list
    completions: list
    completion_ids: list
    columns: dict

    def __len__(self) -> int:
        return len(self.completions)

    def arguments(self) -> dict:
        return {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
                **self.columns}

    def row(self, i: int) -> dict:
        """Row i's values under the per-sample names (``prompt``, ``completion``, ``completion_ids``, columns)."""
        out = {_SINGULAR[k]: v[i] for k, v in self.arguments().items() if k in _SINGULAR}
        out.update({k: v[i] for k, v in self.columns.items()})
        return out


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


@dataclass(frozen=True)
class RewardCall:
    """A reward function and how to call it (see the module docstring)."""

    fn: Callable
    name: str  # in metrics (``rewards/<name>/mean``): TRL's ``__name__``
    qualified: str  # in errors: module and qualified name
    per_sample: bool
    positional: bool
    is_async: bool
    accepts: Optional[frozenset]  # keyword names it takes; None: every one (``**kwargs``)
    required: frozenset  # keyword names it cannot do without

    @classmethod
    def of(cls, fn: Callable, name: Optional[str] = None) -> "RewardCall":
        qualified = reward_function_name(fn)
        name = name or getattr(fn, "__name__", None) or qualified
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: the old positional convention
            return cls(fn, name, qualified, False, True, _is_async(fn), frozenset(), frozenset())
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        names = {p.name for p in named}
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params)
        per_sample = bool(names & {"prompt", "completion"}) and not names & {"prompts", "completions"}
        standard = {"prompt", "completion", "completion_ids"} if per_sample else set(STANDARD_ARGUMENTS)
        required = {p.name for p in named if p.default is p.empty}
        positional = (not per_sample and not names & set(STANDARD_ARGUMENTS)
                      and len([p for p in named if p.kind == p.POSITIONAL_OR_KEYWORD]) >= 2
                      and not takes_all)
        if positional:  # f(p, c): its first two parameters are the prompts and completions
            first_two = {p.name for p in named[:2]}
            required -= first_two
            names -= first_two
        return cls(fn, name, qualified, per_sample, positional, _is_async(fn), None if takes_all else frozenset(names),
                   frozenset(required - standard))

    def check_arguments(self, columns: Sequence[str]) -> None:
        """RewardFunctionError when the function needs an argument that no dataset column provides."""
        missing = sorted(self.required - set(columns))
        if missing:
            raise RewardFunctionError(
                f"reward function {self.qualified} needs {', '.join(repr(m) for m in missing)}, which "
                f"{'is not a' if len(missing) == 1 else 'are not'} dataset column{'s' if len(missing) > 1 else ''} "
                f"(the dataset has {sorted(columns) or 'no columns besides the prompt'}; every function also gets "
                f"{', '.join(STANDARD_ARGUMENTS)}). Fix: add the column, or give the parameter a default.")

    def _keywords(self, values: dict) -> dict:
        return values if self.accepts is None else {k: v for k, v in values.items() if k in self.accepts}

    def _batch_call(self, batch: RewardBatch):
        if self.positional:
            return self.fn(batch.prompts, batch.completions, **self._keywords(batch.columns))
        return self.fn(**self._keywords(batch.arguments()))

    def run_sync(self, batch: RewardBatch) -> list:
        """The function's values for the batch (a synchronous function)."""
        if self.per_sample:
            return [self._row_call(batch, i) for i in range(len(batch))]
        return self._batch_call(batch)

    def _row_call(self, batch: RewardBatch, i: int):
        try:
            return self.fn(**self._keywords(batch.row(i)))
        except Exception as err:  # noqa: BLE001 - re-raised naming the row
            raise _RowError(i, err) from err

    async def run_async(self, batch: RewardBatch) -> list:
        """The function's values for the batch (an ``async def`` function; per-sample rows awaited together)."""
        if not self.per_sample:
            return await self._batch_call(batch)

        async def row(i):
            try:
                return await self.fn(**self._keywords(batch.row(i)))
            except Exception as err:  # noqa: BLE001 - re-raised naming the row
                raise _RowError(i, err) from err

        return list(await asyncio.gather(*(row(i) for i in range(len(batch)))))


class _RowError(Exception):
    def __init__(self, row: int, err: BaseException):
        super().__init__(row, err)
        self.row, self.err = row, err


# ------------------------------------------------------------------------------------------ concurrency
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_lock = threading.Lock()


def _thread_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="ppojax-reward")
        return _pool


def call_all(calls: Sequence[RewardCall], batch: RewardBatch) -> list:
    """Every function's raw return value for ``batch``, in order, the functions running at the same time.

    Raises RewardFunctionError naming the function (and the row, for a per-sample function) when one raises;
    the first failing function in order is reported."""
    futures = []
    for call in calls:
        if call.is_async:
            futures.append(asyncio.run_coroutine_threadsafe(call.run_async(batch), event_loop()))
        elif len(calls) == 1:  # nothing to overlap with: no thread hop
            futures.append(_done(call, batch))
        else:
            futures.append(_thread_pool().submit(call.run_sync, batch))
    results = []
    for call, future in zip(calls, futures):
        try:
            results.append(future.result())
        except _RowError as err:
            prompt = batch.prompts[err.row] if err.row < len(batch.prompts) else None
            raise RewardFunctionError(
                f"reward function {call.qualified} raised {type(err.err).__name__}: {err.err} on row {err.row} "
                f"(prompt {_preview(prompt)}, completion {_preview(batch.completions[err.row])})") from err.err
        except Exception as err:  # noqa: BLE001 - re-raised with context
            raise RewardFunctionError(f"reward function {call.qualified} raised {type(err).__name__}: {err} "
                                      f"(on a batch of {len(batch)} rows; first prompt "
                                      f"{_preview(batch.prompts[0] if batch.prompts else None)})") from err
    return results


def _done(call: RewardCall, batch: RewardBatch) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(call.run_sync(batch))
    except BaseException as err:  # noqa: BLE001 - delivered through the future, as the pooled calls are
        future.set_exception(err)
    return future


def _preview(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def none_to_nan(values) -> tuple[Any, np.ndarray]:
    """A returned sequence with None entries -> (the sequence with NaN there, bool mask of the None rows)."""
    if values is None or isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        return values, np.zeros(0, bool)
    if hasattr(values, "dtype") and np.dtype(values.dtype).kind != "O":
        return values, np.zeros(len(values), bool)
    listed = list(values)
    missing = np.array([v is None for v in listed], bool)
    return [np.nan if v is None else v for v in listed], missing
