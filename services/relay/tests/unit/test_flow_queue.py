"""The queue between a GetFlows call's peer streams and its merge is bounded in flows: a
peer's batch counts its length (it counted 1, so --sort-buffer-len-max 100 let a slow
client's call hold 100 batches of 256 flows)."""

from __future__ import annotations

import asyncio

from cilia_relay.merge import WireResponse
from cilia_relay.observer import FlowQueue


def _batch(n: int) -> list[WireResponse]:
    return [WireResponse(i, b"x") for i in range(n)]


def test_a_batch_counts_its_flows_and_a_put_waits_past_maxsize() -> None:
    async def scenario() -> tuple[int, bool, bool, int, int]:
        queue = FlowQueue(maxsize=100)
        await asyncio.wait_for(queue.put(_batch(256)), 1)  # an empty queue takes any batch
        held = queue.qsize()
        second = asyncio.create_task(queue.put(_batch(256)))
        await asyncio.sleep(0.05)
        blocked = not second.done()  # 256 flows queued >= 100: the producer waits
        first = await queue.get()
        await asyncio.wait_for(second, 1)
        single = asyncio.create_task(queue.put("status"))
        await asyncio.sleep(0.05)
        still_blocked = not single.done()
        await queue.get()
        await asyncio.wait_for(single, 1)
        return held, blocked, still_blocked, len(first), queue.qsize()

    held, blocked, still_blocked, first, left = asyncio.run(scenario())
    assert held == 256
    assert blocked and still_blocked
    assert first == 256
    assert left == 1  # the status item
