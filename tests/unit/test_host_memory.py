"""`gateway.commands.host_memory`: the glibc malloc settings the model-running commands apply at start."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from gateway.commands.host_memory import M_ARENA_MAX, M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, tune_glibc_malloc


class FakeLibc:
    def __init__(self, glibc: bool, accept: bool = True):
        self.calls: list[tuple[int, int]] = []
        self.accept = accept
        if glibc:
            self.gnu_get_libc_version = lambda: b"2.99"

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1 if self.accept else 0


def test_settings_go_to_mallopt_on_glibc_only():
    libc = FakeLibc(glibc=True)
    assert tune_glibc_malloc(libc) is True
    assert libc.calls == [(M_ARENA_MAX, 1), (M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 2**31 - 1)]
    other = FakeLibc(glibc=False)
    assert tune_glibc_malloc(other) is False and other.calls == []  # musl or macOS: left alone
    assert tune_glibc_malloc(FakeLibc(glibc=True, accept=False)) is False  # refused: said, not fatal


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="needs glibc")
def test_the_real_glibc_takes_them():
    assert tune_glibc_malloc() is True
    assert tune_glibc_malloc(ctypes.CDLL(ctypes.util.find_library("c"))) is True  # and again: idempotent
