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
