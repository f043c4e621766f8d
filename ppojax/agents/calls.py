"""Calling a user's function from the host loop, sync or async, optionally with a time limit.

``call(fn, args, kwargs, timeout=...)`` returns ``fn(*args, **kwargs)``. An ``async def`` function (or a function that
returns an awaitable) is awaited on the process's one event loop (``ppojax.host``), so the
coroutines of one environment all run on the same loop (a client session it opened in ``reset`` is still usable
in ``step``). With a ``timeout`` a synchronous function runs on a daemon thread of its own; when it has not
returned in time ``CallTimeout`` is raised and the thread is left to finish (Python cannot stop a thread; as a
daemon it never holds up the process's exit). An async function that runs out of time is cancelled.
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from typing import Callable, Optional

from ppojax.host import event_loop

__all__ = ["CallTimeout", "call", "event_loop", "is_async"]


class CallTimeout(Exception):
    """The function did not return within its time limit."""

    def __init__(self, timeout: float):
        super().__init__(f"did not return within {timeout:g} s")
        self.timeout = timeout


def is_async(fn) -> bool:
    """Whether calling ``fn`` gives a coroutine (an ``async def`` function, method or ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


async def _bounded(awaitable, timeout: Optional[float]):
    if timeout is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise CallTimeout(timeout) from None


def _await(awaitable, timeout: Optional[float]):
    return asyncio.run_coroutine_threadsafe(_bounded(awaitable, timeout), event_loop()).result()


def call(fn: Callable, args: tuple = (), kwargs: Optional[dict] = None, *, timeout: Optional[float] = None):
    """``fn(*args, **kwargs)``'s value (awaited when it is awaitable); what ``fn`` raises is raised here, and
    ``CallTimeout`` when ``timeout`` seconds (None: no limit) pass first. (The arguments are passed as a tuple and
    a dict, so a tool may have parameters named ``fn`` or ``timeout``.)"""
    kwargs = kwargs or {}
    if is_async(fn):
        return _await(fn(*args, **kwargs), timeout)
    if timeout is None:
        value = fn(*args, **kwargs)
        return _await(value, None) if inspect.isawaitable(value) else value
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = err

    start = time.monotonic()
    worker = threading.Thread(target=run, name=f"ppojax-tool-{getattr(fn, '__name__', 'call')}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise CallTimeout(timeout)
    if "error" in box:
        raise box["error"]
    value = box["value"]
    if inspect.isawaitable(value):
        return _await(value, max(timeout - (time.monotonic() - start), 0.0))
    return value
