"""The warp-specialized MLA kernels' barrier protocols, checked on the CPU: the seesaw kernel
(kernels/_mla_gluon_seesaw.py, and its persistent form) and, as a control, the ws kernel (kernels/_mla_gluon_ws.py,
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
            "m0_bar": 1, "s1_bar": 1, "p0_bar": 1, "fin_bar": 2, "qpe_bar": 1, "tree_bar": 1}
NAMES = ["producer", "consumer0", "consumer1"]


def tile(j, k=0):
    return ("tile", k, j)


def seesaw(n_tiles: int, n_tma: int, box: bool, variant: str = ""):
    """The seesaw kernel's partitions for one (query tile, chunk) of n_tiles 64-key tiles, the first n_tma of them by
    TMA (n_tma is 0 without TMA, as the kernel sets it)."""
    return seesaw_items([(n_tiles, n_tma if box else 0, None)], box, variant, persistent=False)


def seesaw_items(items, box: bool, variant: str = "", persistent: bool = True):
    """The partitions of the persistent seesaw kernel (`_mla_gluon_seesaw_persistent`) for one program's items, each
    (n_tiles, n_tma, tree_first): its tiles, how many come first by TMA, and the first tile that reaches the tree part
    (None: none does, or a causal launch). persistent=False: the grid kernel (one item; the query issued at once,
    the tree table from the prologue)."""

    tree = any(item[2] is not None for item in items)  # a tree launch (else causal: no tree table)

    def by_tma(k, j):
        return box and j < items[k][1]

    def pairs_of(n):
        return (n + 1) // 2

    def producer():  # _ssp_producer / _ss_producer, then _ss_tiles
        pairs = 0
        for k, (n_tiles, _, tree_first) in enumerate(items):
            if pairs >= 1 and variant != "q_before_release":  # the query's buffers: last read before stage 0's release
                yield wait("empty0", (pairs + 1) & 1, tile(2 * pairs_of(items[k - 1][0]) - 2, k - 1),
                           f"item {k}: Q's and P0's readers done")
            yield write("q", ("q", k), "query latent")
            yield write("p0", ("qpe", k), "query rope columns")
            yield arrive("q_bar", ("q", k))
            for j in range(2 * pairs_of(n_tiles)):  # pairs; an odd chunk ends with a phantom tile
                st = j % 2
                if 2 * pairs + j >= 2:
                    prev = tile(j - 2, k) if j >= 2 else tile(2 * pairs_of(items[k - 1][0]) - 2 + st, k - 1)
                    yield wait(f"empty{st}", (pairs + j // 2 + 1) & 1, prev, f"stage {st} free for tile {k}.{j}")
                if not by_tma(k, j) and tree_first is not None and j >= tree_first:
                    if persistent and j == tree_first and variant != "no_tree_wait":
                        yield wait("tree_bar", k & 1, ("tree", k), f"item {k}'s tree table")
                    yield read("tree", ("tree", k), f"tree rows of tile {k}.{j}")
                yield write(f"kv{st}", tile(j, k), f"tile {k}.{j}")
                yield arrive(f"full_tma{st}" if by_tma(k, j) else f"full_cp{st}", tile(j, k))
            pairs += pairs_of(n_tiles)

    def consumer(W):  # _ssp_consumer / _ss_consumer
        pairs, tb, cb = 0, [0, 0], [0, 0]  # running pairs; TMA / cp.async completions per stage so far

        def tile_wait(k, j):  # _ss_wait
            st, n_tma = j % 2, items[k][1]
            if by_tma(k, j):
                yield wait(f"full_tma{st}", tb[st] + j // 2, tile(j, k), f"tile {k}.{j} by TMA")
            else:
                phase = (j - n_tma) // 2 if variant != "cp_phase_from_j" else j // 2
                yield wait(f"full_cp{st}", cb[st] + phase, tile(j, k), f"tile {k}.{j} by cp.async")

        for k, (n_tiles, n_tma, _) in enumerate(items):
            if persistent and W == 0 and tree:  # every item of a tree launch, whether it reaches the tree part
                yield write("tree", ("tree", k), "tree table")
                yield arrive("tree_bar", ("tree", k))
            yield wait("q_bar", k & 1, ("q", k), "query tile")
            yield read("p0", ("qpe", k), "rope columns to registers")
            if W == 1:
                yield arrive("qpe_bar")
            else:
                yield wait("qpe_bar", k & 1, None, "consumer 1 has its rope columns")
            for i in range(pairs_of(n_tiles)):
                g, j = pairs + i, 2 * i + W  # g: the program's pair count, the hand-offs' phase
                yield from tile_wait(k, j)
                yield read_async("q", ("q", k), "S", f"S of tile {k}.{j}")  # _ss_scores: two wgmmas, then waited
                yield read_async(f"kv{j % 2}", tile(j, k), "S", f"S of tile {k}.{j}")
                yield retire("S")
                if W == 0:
                    yield write("m0", ("m0", g))
                    yield write("s0", ("s0", g))
                    yield arrive("m0_bar", ("m0", g))
                    yield write("p0", ("p0", g), f"P0 of pair {g}")
                    yield arrive("p0_bar", ("p0", g))
                    yield read_async("kv0", tile(2 * i, k), "PV0", "P0 V0L")  # P0 from registers
                    if variant == "release_before_retire":
                        yield arrive("empty0", tile(2 * i, k))
                    yield wait("s1_bar", g, ("s1", g), f"m1, s1, P1 of pair {g}")
                    yield read("m1", ("m1", g))
                    yield read("s1", ("s1", g))
                    yield retire("PV0")
                    if variant != "release_before_retire":
                        yield arrive("empty0", tile(2 * i, k))
                    yield from tile_wait(k, j + 1)
                    yield read_async("p1", ("p1", g), "PV1", "P1 V1L")
                    yield read_async("kv1", tile(2 * i + 1, k), "PV1", "P1 V1L")
                    yield retire("PV1")
                    yield arrive("empty1", tile(2 * i + 1, k))
                else:
                    yield wait("m0_bar", g, ("m0", g), f"m0, s0 of pair {g}")
                    yield read("m0", ("m0", g))
                    yield read("s0", ("s0", g))
                    yield write("p1", ("p1", g), f"P1 of pair {g}")
                    yield write("m1", ("m1", g))
                    yield write("s1", ("s1", g))
                    yield arrive("s1_bar", ("s1", g))
                    if variant != "no_p0_wait":
                        yield wait("p0_bar", g, ("p0", g), f"P0 of pair {g}")
                    yield from tile_wait(k, j - 1)
                    yield read_async("p0", ("p0", g), "PV0", "P0 V0R")
                    yield read_async("kv0", tile(2 * i, k), "PV0", "P0 V0R")
                    yield retire("PV0")
                    yield arrive("empty0", tile(2 * i, k))
                    yield read_async("kv1", tile(2 * i + 1, k), "PV1", "P1 V1R")  # P1 from registers
                    yield retire("PV1")
                    yield arrive("empty1", tile(2 * i + 1, k))
            # the row sums' exchange: consumer 0's in s0's buffer, consumer 1's in m0's
            theirs = "s1" if variant == "row_sums_via_s1" else "m0"
            yield write("s0" if W == 0 else theirs, ("l", k, W), "row sums")
            yield arrive("fin_bar")
            yield wait("fin_bar", k & 1, None, "both row sums")
            yield read("s0", ("l", k, 0))
            yield read(theirs, ("l", k, 1))
            n_pairs = pairs_of(n_tiles)
            for st in (0, 1):  # this item's TMA tiles in stage st: the even / odd j < n_tma
                t = (n_tma + 1 - st) // 2 if box else 0
                tb[st] += t
                cb[st] += n_pairs - t
            pairs += n_pairs

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


def _item_runs():
    """Runs of 2-3 items for one program of the persistent seesaw kernel: (items, box). Odd and even tile counts
    (phantoms), every TMA prefix length on a few, items that reach the tree part at their first, a middle or their
    last tile, and causal ones (no tree table)."""
    shapes = [(1, 0, None), (2, 0, None), (3, 0, 2), (4, 0, 0), (5, 0, None), (1, 0, 0), (2, 0, 1)]
    tma = [(1, 1, None), (2, 2, None), (3, 1, 2), (3, 3, None), (4, 2, 3), (5, 5, None), (2, 1, 1), (4, 0, 0)]
    runs = [([a, b], False) for a in shapes for b in shapes[:4]]
    runs += [([a, b], True) for a in tma for b in tma[:4]]
    runs += [([(3, 1, 2), (5, 5, None), (2, 0, 1)], True), ([(1, 0, 0), (1, 0, None), (3, 0, 2)], False),
             ([(5, 3, None), (1, 1, None), (4, 2, 3)], True)]
    return runs


@pytest.mark.parametrize("items,box", _item_runs())
def test_persistent_seesaw_protocol_has_no_deadlock_or_race(items, box):
    for pick in schedules(3, seeds=24):
        assert run(seesaw_items(items, box), BARRIERS, pick, NAMES) > 0


PERSISTENT_VARIANTS = {
    # the next query tile issued as soon as the previous item's tiles were, not after stage 0's last release: it
    # overwrites Q and P0 (the rope columns' buffer) under the previous item's last S and P0 V0R
    "q_before_release": ([(2, 0, None), (2, 0, None)], False),
    # the producer reads the tree table without waiting for consumer 0 to have written this item's
    "no_tree_wait": ([(3, 0, 2), (2, 0, 1)], False),
    # consumers' cp.async phases as if each item started from phase 0 (the grid kernel's formula)
    "cp_phase_from_j": ([(3, 1, 2), (4, 1, None)], True),
}


@pytest.mark.parametrize("variant", sorted(PERSISTENT_VARIANTS))
def test_wrong_persistent_protocols_fail(variant):
    items, box = PERSISTENT_VARIANTS[variant]
    errors = []
    for pick in schedules(3, seeds=24):
        try:
            run(seesaw_items(items, box, variant), BARRIERS, pick, NAMES)
        except ProtocolError as e:
            errors.append(str(e))
    assert errors, f"{variant} passed every schedule"
