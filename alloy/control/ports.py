"""Free TCP ports for the processes we start (the Ray head, test servers) on a shared machine.

Every port comes from a range that stays clear of the ports other software on the machine expects (Redis 6379,
Serve 8000, the dashboard 8265, and the 10002-19999 range other tools use).
"""

from __future__ import annotations

import os
import random
import time

from alloy.errors import AlloyError, ErrorCode
from alloy.http_port import RESERVED_PORTS, port_is_free

# Ports we may use; everything below 20000 is left alone (Redis 6379, Serve 8000, dashboard 8265, and the
# 10002-19999 range other tools on the machine use).
PORT_RANGE = (20000, 39999)
WORKER_PORT_SPAN = 200


def pick_port_block(count: int, *, span_after: int = 0, rng: random.Random | None = None) -> list[int]:
    """``count`` consecutive free ports followed by ``span_after`` more free ones (worker ports), from a random
    base inside PORT_RANGE so two concurrent runs almost never collide (and a taken port is skipped anyway)."""
    rng = rng or random.Random(os.getpid() ^ time.time_ns())
    low, high = PORT_RANGE
    needed = count + span_after
    for _ in range(200):
        base = rng.randrange(low, high - needed)
        block = range(base, base + needed)
        if any(p in RESERVED_PORTS for p in block):
            continue
        # Checking every worker port would be slow and racy; the named ports must be free, worker ports are
        # sampled.
        if all(port_is_free(p) for p in block[:count]) and all(
            port_is_free(p) for p in block[count :: max(1, span_after // 8)]
        ):
            return list(block)
    raise AlloyError(ErrorCode.SERVICE_UNAVAILABLE, f"no free block of {needed} ports in {PORT_RANGE}")
