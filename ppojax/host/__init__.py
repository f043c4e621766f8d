"""What the host process shares between the layers that call a user's Python: one asyncio event loop, on a daemon
thread started on first use, that every ``async def`` reward function, tool and environment method is awaited on.
One loop, not one per layer, because a user's object may hold loop-bound state across them (a client session an
environment opens in ``reset`` and its ``get_reward`` reward or a tool then uses). Imports nothing of ppojax."""
from ppojax.host.event_loop import event_loop

__all__ = ["event_loop"]
