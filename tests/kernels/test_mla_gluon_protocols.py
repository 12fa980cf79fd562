"""The warp-specialized MLA kernels' barrier protocols, checked on the CPU: the seesaw kernel
(kernels/_mla_gluon_seesaw.py, never run on a GPU yet) and, as a control, the ws kernel (kernels/_mla_gluon_ws.py,
validated on the H200).

Gluon has no interpreter, so these kernels only run on a GPU, where a protocol mistake is a hang or a silent race.
This file replays each kernel's partitions (a producer warp, consumers 0 and 1) line for line as the shared-memory
and mbarrier operations they perform, and runs them with `tests.kernels.mbarrier_sim` under every fixed priority
order of the partitions and many random interleavings, for chunks of 1 to 7 tiles (the seesaw: with every split
between TMA and cp.async tiles). It checks: no deadlock; every wait passes on the phase of the tile / pair it is meant
for; every buffer (Q, the two KV stages, the P buffers, the row statistics) is rewritten only after its readers, MMAs
included, are done with it, and read only after its writer is. Keep it in step with the kernels; `VARIANTS` holds
known-wrong versions of the seesaw (one of them its row-sum exchange before this file found it racing) that must each
fail.
"""

from __future__ import annotations

import pytest

from tests.kernels.mbarrier_sim import ProtocolError, arrive, read, read_async, retire, run, schedules, wait, write

BARRIERS = {"q_bar": 1, "full_tma0": 1, "full_tma1": 1, "full_cp0": 1, "full_cp1": 1, "empty0": 2, "empty1": 2,
            "m0_bar": 1, "s1_bar": 1, "p0_bar": 1, "fin_bar": 2, "qpe_bar": 1}
NAMES = ["producer", "consumer0", "consumer1"]


def tile(j):
    return ("tile", j)


def seesaw(n_tiles: int, n_tma: int, box: bool, variant: str = ""):
    """The seesaw kernel's partitions for one (query tile, chunk) of n_tiles 64-key tiles, the first n_tma of them by
    TMA (n_tma is 0 without TMA, as the kernel sets it)."""
    n_tma = n_tma if box else 0

    def by_tma(j):
        return box and j < n_tma

    def producer():  # _ss_producer
        yield write("q", "q", "query latent")
        yield write("p0", "qpe", "query rope columns")
        yield arrive("q_bar", "q")
        for j in range(2 * ((n_tiles + 1) // 2)):  # pairs; an odd chunk ends with a phantom tile
            st = j % 2
            if j >= 2:
                yield wait(f"empty{st}", (j // 2 + 1) & 1, tile(j - 2), f"stage {st} free for tile {j}")
            yield write(f"kv{st}", tile(j), f"tile {j}")
            yield arrive(f"full_tma{st}" if by_tma(j) else f"full_cp{st}", tile(j))

    def tile_wait(j):  # _ss_wait
        st = j % 2
        if by_tma(j):
            yield wait(f"full_tma{st}", (j // 2) & 1, tile(j), f"tile {j} by TMA")
        else:
            phase = (j - n_tma) // 2 if variant != "cp_phase_from_j" else j // 2
            yield wait(f"full_cp{st}", phase & 1, tile(j), f"tile {j} by cp.async")

    def consumer(W):  # _ss_consumer
        n_pairs = (n_tiles + 1) // 2
        yield wait("q_bar", 0, "q", "query tile")
        yield read("p0", "qpe", "rope columns to registers")
        if W == 1:
            yield arrive("qpe_bar")
        else:
            yield wait("qpe_bar", 0, None, "consumer 1 has its rope columns")
        for i in range(n_pairs):
            j = 2 * i + W
            yield from tile_wait(j)
            yield read_async("q", "q", "S", f"S of tile {j}")  # _ss_scores: two wgmmas, then waited
            yield read_async(f"kv{j % 2}", tile(j), "S", f"S of tile {j}")
            yield retire("S")
            if W == 0:
                yield write("m0", ("m0", i))
                yield write("s0", ("s0", i))
                yield arrive("m0_bar", ("m0", i))
                yield write("p0", ("p0", i), f"P0 of pair {i}")
                yield arrive("p0_bar", ("p0", i))
                yield read_async("kv0", tile(2 * i), "PV0", "P0 V0L")  # P0 from registers
                if variant == "release_before_retire":
                    yield arrive("empty0", tile(2 * i))
                yield wait("s1_bar", i & 1, ("s1", i), f"m1, s1, P1 of pair {i}")
                yield read("m1", ("m1", i))
                yield read("s1", ("s1", i))
                yield retire("PV0")
                if variant != "release_before_retire":
                    yield arrive("empty0", tile(2 * i))
                yield from tile_wait(j + 1)
                yield read_async("p1", ("p1", i), "PV1", "P1 V1L")
                yield read_async("kv1", tile(2 * i + 1), "PV1", "P1 V1L")
                yield retire("PV1")
                yield arrive("empty1", tile(2 * i + 1))
            else:
                yield wait("m0_bar", i & 1, ("m0", i), f"m0, s0 of pair {i}")
                yield read("m0", ("m0", i))
                yield read("s0", ("s0", i))
                yield write("p1", ("p1", i), f"P1 of pair {i}")
                yield write("m1", ("m1", i))
                yield write("s1", ("s1", i))
                yield arrive("s1_bar", ("s1", i))
                if variant != "no_p0_wait":
                    yield wait("p0_bar", i & 1, ("p0", i), f"P0 of pair {i}")
                yield from tile_wait(j - 1)
                yield read_async("p0", ("p0", i), "PV0", "P0 V0R")
                yield read_async("kv0", tile(2 * i), "PV0", "P0 V0R")
                yield retire("PV0")
                yield arrive("empty0", tile(2 * i))
                yield read_async("kv1", tile(2 * i + 1), "PV1", "P1 V1R")  # P1 from registers
                yield retire("PV1")
                yield arrive("empty1", tile(2 * i + 1))
        # the row sums' exchange: consumer 0's in s0's buffer, consumer 1's in m0's
        theirs = "s1" if variant == "row_sums_via_s1" else "m0"
        yield write("s0" if W == 0 else theirs, ("l", W), "row sums")
        yield arrive("fin_bar")
        yield wait("fin_bar", 0, None, "both row sums")
        yield read("s0", ("l", 0))
        yield read(theirs, ("l", 1))

    return [producer, lambda: consumer(0), lambda: consumer(1)]


CASES = [(n, 0, False) for n in range(1, 8)] + [(n, t, True) for n in range(1, 8) for t in range(n + 1)]


@pytest.mark.parametrize("n_tiles,n_tma,box", CASES)
def test_seesaw_protocol_has_no_deadlock_or_race(n_tiles, n_tma, box):
    for pick in schedules(3, seeds=40):
        steps = run(seesaw(n_tiles, n_tma, box), BARRIERS, pick, NAMES)
        assert steps > 0


VARIANTS = {
    # the kernel before this file: consumer 1 put its row sums in s1's buffer, which consumer 0 may still be reading
    # (the last pair's s1) when consumer 1 gets to the end
    "row_sums_via_s1": (3, 0, False),
    # stage 0 released while consumer 0's P0 V0L still reads it
    "release_before_retire": (4, 2, True),
    # consumer 1 reads P0 without waiting for it
    "no_p0_wait": (2, 0, False),
    # cp.async tiles waited on the phase their index would have if every tile came by cp.async
    "cp_phase_from_j": (5, 1, True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_wrong_protocols_fail(variant):
    n_tiles, n_tma, box = VARIANTS[variant]
    errors = []
    for pick in schedules(3, seeds=40):
        try:
            run(seesaw(n_tiles, n_tma, box, variant), BARRIERS, pick, NAMES)
        except ProtocolError as e:
            errors.append(str(e))
    assert errors, f"{variant} passed every schedule"


WS_BARRIERS = {"q_bar": 1, "full0": 1, "full1": 1, "empty0": 2, "empty1": 2, "p_bar": 1}


def ws(n_tiles: int):
    """The ws kernel's partitions: tile j is owned by consumer j % 2 (S, softmax, P_j published), both add P_j V_j."""

    def producer():  # _producer
        yield write("q", "q", "query")
        yield arrive("q_bar", "q")
        for j in range(n_tiles):
            st = j % 2
            if j >= 2:
                yield wait(f"empty{st}", (j // 2 + 1) & 1, tile(j - 2), f"stage {st} free for tile {j}")
            yield write(f"kv{st}", tile(j), f"tile {j}")
            yield arrive(f"full{st}", tile(j))

    def own(j):  # _own_tile
        st = j % 2
        yield wait(f"full{st}", (j // 2) & 1, tile(j), f"tile {j}")
        yield read_async("q", "q", "S", f"S of tile {j}")
        yield read_async(f"kv{st}", tile(j), "S", f"S of tile {j}")
        yield retire("S")
        yield write("p", ("p", j), f"P of tile {j}")
        yield write("stats", ("stats", j), f"m, l, alpha of tile {j}")
        yield arrive("p_bar", ("p", j))
        yield read_async(f"kv{st}", tile(j), "PV", f"PV of tile {j}")  # P from registers
        yield retire("PV")
        yield arrive(f"empty{st}", tile(j))

    def take_other(j):  # _take_other
        st = j % 2
        yield wait("p_bar", j & 1, ("p", j), f"P of tile {j}")
        yield wait(f"full{st}", (j // 2) & 1, tile(j), f"tile {j}")
        yield read("stats", ("stats", j))
        yield read_async("p", ("p", j), "PV", f"PV of tile {j}")
        yield read_async(f"kv{st}", tile(j), "PV", f"PV of tile {j}")
        yield retire("PV")
        yield arrive(f"empty{st}", tile(j))

    def consumer(W):  # _consumer
        yield wait("q_bar", 0, "q", "query tile")
        if W == 0:
            yield from own(0)
        for j in range(2 - W, n_tiles, 2):
            yield from take_other(j - 1)
            yield from own(j)
        if (n_tiles - 1) % 2 != W:
            yield from take_other(n_tiles - 1)

    return [producer, lambda: consumer(0), lambda: consumer(1)]


@pytest.mark.parametrize("n_tiles", range(1, 8))
def test_ws_protocol_has_no_deadlock_or_race(n_tiles):
    """The control: the GPU-validated ws kernel passes the checks the seesaw is held to."""
    for pick in schedules(3, seeds=40):
        assert run(ws(n_tiles), WS_BARRIERS, pick, NAMES) > 0
