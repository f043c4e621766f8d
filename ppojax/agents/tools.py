"""Running the tool calls of a batch of episodes: results are observation texts, never exceptions.

As in TRL, what goes wrong in a tool call is told to the model, not raised:

    the tool returned v            ``str(v)``                                        (status "ok")
    the tool raised e              ``str({"error": str(e)})``, TRL's text           (status "error")
    no tool has that name          ``str({"error": "Tool <name> not found."})``, TRL's text   ("error")
    the tool ran past its timeout  ``str({"error": "Tool <name> timed out after <t> s."})``   ("timeout")
    the call is malformed          ``str({"error": "Malformed tool call: <what was wrong>. Expected <format>."})``
                                                                                     (status "malformed")

(TRL has no time limit, and a malformed call there ends the episode as plain text; ppojax answers both so the
model can recover.) ``ToolCounters`` counts every call written (malformed ones included) and each failure kind.

The calls of one episode run one after the other, in the order written (an environment's tools share its
state); the episodes of a batch run at the same time on a thread pool. Each call has its own time limit
(``ppojax.agents.calls.call``): a synchronous tool that hangs is abandoned on its daemon thread, an async one
is cancelled.
"""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence, Union

from ppojax.agents.calls import CallTimeout, call
from ppojax.agents.parsers import MalformedCall, ToolCall
from ppojax.agents.schemas import tool_name
from ppojax.errors import ConfigError

__all__ = ["DEFAULT_TOOL_TIMEOUT", "ToolCounters", "ToolResult", "ToolRunner", "tool_table"]

#: seconds a tool call may run before its observation becomes a timeout message
DEFAULT_TOOL_TIMEOUT = 30.0

STATUSES = ("ok", "error", "timeout", "malformed")


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome. name: the tool called ("unknown" when a malformed call names none); content: the
    observation text; status: one of ``STATUSES``."""

    name: str
    content: str
    status: str

    def message(self) -> dict:
        """The result as a chat message for the template (TRL's tool message)."""
        return {"role": "tool", "name": self.name, "content": self.content}


@dataclass
class ToolCounters:
    """Counts since the last ``reset``: calls (every call written, malformed ones included), errors (the tool
    raised, or no tool has that name), timeouts, malformed."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    malformed: int = 0

    def count(self, status: str) -> None:
        self.calls += 1
        if status == "error":
            self.errors += 1
        elif status == "timeout":
            self.timeouts += 1
        elif status == "malformed":
            self.malformed += 1

    def metrics(self, prefix: str = "tools/") -> dict:
        """The counts as metrics: ``{prefix + "calls": ..., "errors", "timeouts", "malformed"}``."""
        return {f"{prefix}{k}": float(getattr(self, k)) for k in ("calls", "errors", "timeouts", "malformed")}

    def reset(self) -> None:
        self.calls = self.errors = self.timeouts = self.malformed = 0


def error_text(message: str) -> str:
    """An error observation in TRL's form: the text of the dict ``{"error": message}``."""
    return str({"error": message})


def tool_table(tools: Iterable[Callable]) -> dict:
    """``{name the model calls it by: tool}`` (``ppojax.agents.schemas.tool_name``)."""
    return {tool_name(fn): fn for fn in tools}


Calls = Sequence[Union[ToolCall, MalformedCall]]


class ToolRunner:
    """Runs tool calls and keeps the counters.

    timeout: seconds per call (None: no limit); max_workers: episodes run at the same time by ``run_batch``."""

    def __init__(self, timeout: Optional[float] = DEFAULT_TOOL_TIMEOUT, max_workers: int = 16):
        if timeout is not None and not timeout > 0:
            raise ConfigError(f"tool timeout {timeout!r}: expected a positive number of seconds, or None for no "
                              "limit.")
        self.timeout = timeout
        self.max_workers = max_workers
        self.counters = ToolCounters()
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def call_one(self, request: Union[ToolCall, MalformedCall], tools: Mapping[str, Callable]) -> ToolResult:
        """One call's result (never raises for the tool's sake); counted."""
        result = self._result(request, tools)
        with self._lock:
            self.counters.count(result.status)
        return result

    def _result(self, request, tools: Mapping[str, Callable]) -> ToolResult:
        if isinstance(request, MalformedCall):
            return ToolResult(request.name or "unknown",
                              error_text(f"Malformed tool call: {request.error}. Expected {request.expected}."),
                              "malformed")
        fn = tools.get(request.name)
        if fn is None:
            return ToolResult(request.name, error_text(f"Tool {request.name} not found."), "error")
        try:
            value = call(fn, (), request.arguments, timeout=self.timeout)
        except CallTimeout:
            return ToolResult(request.name, error_text(f"Tool {request.name} timed out after {self.timeout:g} s."),
                              "timeout")
        except Exception as err:  # noqa: BLE001 - a tool's failure is an observation for the model
            return ToolResult(request.name, error_text(str(err)), "error")
        return ToolResult(request.name, str(value), "ok")

    def run(self, calls: Calls, tools: Mapping[str, Callable]) -> list:
        """One episode's calls, one after the other: a ToolResult per call, in order."""
        return [self.call_one(c, tools) for c in calls]

    def run_batch(self, batch: Sequence[Calls], tools: Union[Mapping[str, Callable], Sequence[Mapping]]) -> list:
        """B episodes' calls, the episodes at the same time: B lists of ToolResults.

        tools: one ``{name: tool}`` table for every episode, or B tables (one per episode: each episode's
        environment has its own bound methods)."""
        tables = [tools] * len(batch) if isinstance(tools, Mapping) else list(tools)
        if len(tables) != len(batch):
            raise ValueError(f"{len(tables)} tool tables for {len(batch)} episodes; expected one per episode.")
        busy = [i for i, calls in enumerate(batch) if calls]
        if len(busy) <= 1:
            return [self.run(calls, table) for calls, table in zip(batch, tables)]
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="ppojax-tools")
        futures = [self._pool.submit(self.run, calls, table) for calls, table in zip(batch, tables)]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Shut the episode pool down (the runner may be used again: a new pool starts on demand)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
