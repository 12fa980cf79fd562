"""The device tree check replayed from CUDA graphs: one launch per step instead of a dozen host ops.

A co-located drafter writes every step's trees to the same place (offset 0 of the stream's response
region), and `TreeChecker.expect` uploads the node counts and roots to one static buffer per batch size
while the drafter works. So the check of a step's trees reads the same addresses every step, and one CUDA
graph per (tree buffer address, R, M) holds it: replaying it costs one host call, where the eager path
pays the kernel's launch, its output allocation and the views (each 20-50 us of host time next to a busy
GPU, measured on the H200 host). Graphs are captured on first use (`kernels.graph_capture`, one memory pool
each: the outputs of one never alias another's) and dropped when the stream, and with it the region,
changes (`clear`). A capture that fails leaves that key eager.
"""

from __future__ import annotations

import logging

import torch

from kernels.graph_capture import GraphCapture, warn_once
from kernels.tree_check import check_packed

log = logging.getLogger(__name__)


def indexed(device: torch.device | str) -> torch.device:
    """"cuda" -> "cuda:<current>" (what a tensor's .device says), anything else as it is."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class CheckGraphs:
    def __init__(self, device: torch.device | str, vocab_size: int, max_depth: int, limit: int = 64):
        device = indexed(device)
        self.device, self.vocab_size, self.max_depth, self.limit = device, vocab_size, max_depth, limit
        self._graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._failed: dict[tuple[int, int, int], str] = {}
        self._counts: dict[int, torch.Tensor] = {}  # R -> [2, R] int64: node counts, roots
        self._warned: set[str] = set()
        self.stats = {"replays": 0, "captures": 0}

    def serves(self, device: torch.device | str) -> bool:
        """Whether trees checked on `device` can replay these graphs."""
        return indexed(device) == self.device

    def counts(self, R: int) -> torch.Tensor:
        """The static [2, R] int64 buffer (node counts, roots) the graphs of batch size R read."""
        buf = self._counts.get(R)
        if buf is None:
            buf = self._counts[R] = torch.zeros(2, R, dtype=torch.int64, device=self.device)
        return buf

    def run(self, packed: torch.Tensor, counts: torch.Tensor) -> tuple | None:
        """check_packed(a copy of packed, *counts) from this (address, shape)'s graph -> its outputs (codes, tokens,
        parent, depth; static: valid until this graph replays again); None when it runs eagerly (the counts are
        not the static buffer, `limit` graphs exist already, or its capture failed). The graph first copies the
        trees into memory of its own: the kernel reads a node more than once, and the peer's region is not
        ours to trust between two reads."""
        R, M = packed.shape[1], packed.shape[2]
        if counts is not self._counts.get(R) or packed.device != self.device:
            return None
        key = (packed.data_ptr(), R, M)
        graphs, failed = self._graphs, self._failed  # `clear` (another thread) swaps in new ones
        entry = graphs.get(key)
        if entry is None:
            if key in failed or len(graphs) >= self.limit:
                return None
            entry = GraphCapture(self.device).capture_or_record(
                key, lambda: check_packed(packed.clone(), counts[0], counts[1], self.vocab_size, self.max_depth),
                graphs, failed, lambda msg: warn_once(log, self._warned, msg), f"the tree check {key[1:]}")
            if entry is None:
                return None
            self.stats["captures"] += 1
        graph, out = entry
        graph.replay()
        self.stats["replays"] += 1
        return out

    def clear(self) -> None:
        """Forget every graph (their tree buffers are gone: a new stream has new regions). A graph keeps its
        buffer's memory alive, so one replayed meanwhile still reads memory of its own."""
        self._graphs, self._failed = {}, {}
