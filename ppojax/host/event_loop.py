"""The process's one event loop for users' async functions (the package's docstring says why one)."""
from __future__ import annotations

import asyncio
import threading
from typing import Optional

_loop: Optional[asyncio.AbstractEventLoop] = None
_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The loop, running forever on a daemon thread (it never holds up the process's exit); started on first use.
    Submit work with ``asyncio.run_coroutine_threadsafe(coroutine, event_loop())``."""
    global _loop
    with _lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="ppojax-async-calls", daemon=True).start()
        return _loop
