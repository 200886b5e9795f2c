"""The runtime of the running event loop, for inspection and shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

from ._runtime.reactor import get_reactor

__all__ = ["aclose", "stats"]


def stats(loop: asyncio.AbstractEventLoop | None = None) -> dict[str, Any]:
    """Counters of the loop's engine: submit calls, chunks, requests in flight..."""
    return get_reactor(loop).stats()


async def aclose() -> None:
    """Drain and close the running loop's runtime: pending transfers are
    cancelled, those in flight are waited for. The next call makes a new one."""
    loop = asyncio.get_running_loop()
    r = getattr(loop, "_aionvme_reactor", None)
    if r is not None and not r.closed:
        r.close()
        await asyncio.sleep(0)
