"""Admission control (gateway.admission): bounded running set, bounded FIFO queue, RESOURCE_EXHAUSTED when
full, cancelled waiters leave the queue, a slot handed to a waiter cancelled at that moment is not lost."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission import Admission
from gateway.errors import GatewayError


def run(coro):
    return asyncio.run(coro)


async def hold(adm: Admission, order: list, name: str, release: asyncio.Event) -> None:
    async with adm.slot():
        order.append(name)
        await release.wait()


def test_queue_limits_fifo_and_refusal():
    async def main():
        seen: list[tuple[int, int]] = []
        adm = Admission(2, 2, lambda r, q: seen.append((r, q)))
        order, gates = [], {n: asyncio.Event() for n in "abcd"}
        tasks = [asyncio.create_task(hold(adm, order, n, gates[n])) for n in "abcd"]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.queued, order) == (2, 2, ["a", "b"])
        with pytest.raises(GatewayError) as e:
            async with adm.slot():
                pass
        assert e.value.code == "RESOURCE_EXHAUSTED" and "queue limit 2" in e.value.message
        gates["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "c"] and (adm.running, adm.queued) == (2, 1)  # FIFO: c before d
        for g in gates.values():
            g.set()
        await asyncio.gather(*tasks)
        assert (adm.running, adm.queued) == (0, 0) and seen[-1] == (0, 0) and max(r for r, _ in seen) == 2
    run(main())


def test_cancelled_waiter_leaves_the_queue():
    async def main():
        adm = Admission(1, 1)
        gate = asyncio.Event()
        a = asyncio.create_task(hold(adm, [], "a", gate))
        await asyncio.sleep(0)
        b = asyncio.create_task(hold(adm, [], "b", asyncio.Event()))
        await asyncio.sleep(0.01)
        assert adm.queued == 1
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
        assert (adm.running, adm.queued) == (1, 0)
        gate.set()
        await a
        assert adm.running == 0
    run(main())


def test_slot_handed_to_a_waiter_cancelled_at_that_moment_passes_on():
    async def main():
        adm = Admission(1, 2)
        gate = asyncio.Event()
        order: list[str] = []
        a = asyncio.create_task(hold(adm, order, "a", gate))
        await asyncio.sleep(0)
        b = asyncio.create_task(hold(adm, order, "b", asyncio.Event()))
        c_gate = asyncio.Event()
        c = asyncio.create_task(hold(adm, order, "c", c_gate))
        await asyncio.sleep(0.01)
        gate.set()  # a leaves and hands its slot to b ...
        await asyncio.sleep(0)
        b.cancel()  # ... which is cancelled before it runs again
        await asyncio.gather(a, b, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert order == ["a", "c"] and adm.running == 1  # c got the slot
        c_gate.set()
        await c
        assert (adm.running, adm.queued) == (0, 0)
    run(main())


def test_zero_queue_refuses_at_once_when_busy():
    async def main():
        adm = Admission(1, 0)
        async with adm.slot():
            with pytest.raises(GatewayError):
                async with adm.slot():
                    pass
    run(main())
