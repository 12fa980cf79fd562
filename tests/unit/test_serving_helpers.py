"""protos.serving helpers that need no server."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from protos.serving import cancel_quietly


async def _stubborn():
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        raise RuntimeError("RPC already finished") from None  # what a stream read does when its RPC ends first


async def _cancel(quiet: bool) -> None:
    task = asyncio.ensure_future(_stubborn())
    await asyncio.sleep(0)  # the task is waiting
    if quiet:
        cancel_quietly(task)
    else:
        task.cancel()
    await asyncio.sleep(0.01)  # it ends with the RuntimeError, not cancelled


@pytest.mark.parametrize("quiet", [False, True])
def test_cancel_quietly_retrieves_a_late_exception(caplog, quiet):
    """A cancelled task that still fails is logged as "Task exception was never retrieved" when collected (the
    drafter's stream reads at the end of a stream did that), unless it was cancelled with cancel_quietly."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(_cancel(quiet))
        gc.collect()
    assert ("exception was never retrieved" in caplog.text) is not quiet, caplog.text


class _EndingStream:
    """A gRPC context whose pending read fails once the RPC has finished (as grpc.aio's does)."""

    def __init__(self, fut: asyncio.Future):
        self.fut = fut

    async def read(self):
        return await self.fut


async def _read_cancelled_as_it_fails() -> None:
    from types import SimpleNamespace

    from drafter_service.server import DrafterService

    fut = asyncio.get_running_loop().create_future()
    reader = asyncio.ensure_future(DrafterService._read(SimpleNamespace(_drain=asyncio.Event()), _EndingStream(fut)))
    await asyncio.sleep(0)  # the handler waits for its read
    fut.set_exception(RuntimeError("RPC already finished"))
    await asyncio.sleep(0)  # the read has failed; the handler has not seen it yet
    reader.cancel()  # the handler is cancelled at that moment (the stream ended)
    with pytest.raises(asyncio.CancelledError):
        await reader
    await asyncio.sleep(0.01)


def test_drafter_read_cancelled_as_it_fails_logs_nothing(caplog):
    """The drafter's stream read that fails in the same turn as its handler is cancelled: its exception is retrieved,
    not logged as "Task exception was never retrieved" at the end of every gRPC stream."""
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(_read_cancelled_as_it_fails())
        gc.collect()
    assert "never retrieved" not in caplog.text, caplog.text
