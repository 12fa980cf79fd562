"""CUDA-graph capture shared by the verifier's and the drafter's graph runners.

`GraphCapture.capture(body)` runs `body` once on a side stream (compiles its kernels, and writes exactly
what a replay writes), then records it into a new `torch.cuda.CUDAGraph` over the static buffers the caller
has loaded, returning (graph, body's output). All graphs of one `GraphCapture` share one memory pool, which
is only safe while each graph's outputs are read before any other graph of the pool replays (a graph
captured earlier may keep its intermediates where a later one's output lives). A failed capture raises
after starting a fresh pool for later captures and synchronising the device; `capture_or_record` records
such a failure for the caller (that key then runs eagerly), and `warn_once` keeps the runners' logs short.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Any

import torch


class GraphCapture:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._mempool = None
        self._stream: torch.cuda.Stream | None = None

    def capture(self, body: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        try:
            if self._mempool is None:
                self._mempool = torch.cuda.graph_pool_handle()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                body()
            torch.cuda.current_stream().wait_stream(self._stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                out = body()
        except Exception:
            self._mempool = None  # later captures start a fresh pool
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - the caller reports the capture error, not this one
                pass
            raise
        return graph, out

    def capture_or_record(self, key: Hashable, body: Callable[[], Any], graphs: dict, failed: dict[Any, str],
                          warn: Callable[[str], None], what: str) -> tuple[torch.cuda.CUDAGraph, Any] | None:
        """capture(body) into graphs[key] -> that entry; when the capture fails, the reason goes to failed[key],
        `warn` is told ("capture of <what> failed, running it eagerly") and None comes back."""
        try:
            graphs[key] = self.capture(body)
        except Exception as exc:  # noqa: BLE001 - recorded; this key runs eagerly from now on
            failed[key] = f"{type(exc).__name__}: {exc}"[:500]
            warn(f"CUDA graphs: capture of {what} failed, running it eagerly: {failed[key]}")
            return None
        return graphs[key]

    def reset(self) -> None:
        """Forget the pool (after the caller dropped its graphs): later captures start a fresh one."""
        self._mempool = None


def warn_once(log: logging.Logger, warned: set[str], msg: str) -> None:
    """Log `msg` as a warning the first time it comes (`warned` holds the ones said)."""
    if msg not in warned:
        warned.add(msg)
        log.warning(msg)
