"""bench/mla_item_model.py: the items it prices are the kernel's chunks, its schedule and fit are exact on known
inputs, and it reads only the default launch's records."""

from __future__ import annotations

import json

import pytest

from bench import mla_item_model as im


def test_a_rows_items_are_its_chunks_in_grid_order():
    # one token at position 1024: K = 1025 keys = 17 tiles of 64, balanced: round(1025 / 512) = 2 chunks of 8 and 9
    items, tiles = im.launch_items(1, 1024, 1, c_min=512)
    assert (items, tiles) == ((8, 9), 1)
    # with 1024-key chunks the same row is one chunk of 17 tiles
    assert im.launch_items(1, 1024, 1, c_min=1024) == ((17,), 1)
    # three sessions of a 2-node tree: 6 query tiles, chunk 0 of each before any chunk 1 (x = tile is fastest)
    items, tiles = im.launch_items(3, 4096, 2, c_min=512)
    assert tiles == 6 and len(items) == 6 * 8
    assert items[:6] == (8,) * 6 and items[-6:] == (9,) * 6  # the last chunk holds the tree keys' extra tile


def test_the_greedy_schedule():
    # 2 SMs, items of 3, 1, 1 tiles at t 1, x 0: SM 0 takes the 3, SM 1 both ones and finishes first
    assert im.makespan([3, 1, 1], 1.0, 0.0, 2) == (3.0, 3, 1)
    span, tiles, count = im.makespan([2, 2, 2], 1.5, 0.5, 2)  # SM0 gets items 1 and 3
    assert (span, tiles, count) == (7.0, 4, 2)


def test_the_fit_recovers_the_parameters_it_was_made_with():
    truth = (1.7, 6.3, 10.0)
    shapes = [(1024, 33), (1024, 65), (4096, 9), (4096, 33), (32768, 9)]
    cases = [dict(batch=4, prefix=p, tree=n, c_min=512, copy_gbps=3000.0, floor_us=1.0) for p, n in shapes]
    for c in cases:
        c["us"] = im.predict(c, truth, sms=16)
    t_tile, x_item, launch = im.fit_model(cases, sms=16, launch=10.0)
    assert t_tile == pytest.approx(1.7, rel=1e-6) and x_item == pytest.approx(6.3, rel=1e-6) and launch == 10.0
    fitted = im.fit_model(cases, sms=16)  # the launch constant fitted too
    assert fitted == pytest.approx(truth, rel=1e-5)


def test_the_combine_is_priced_only_for_split_rows():
    assert im.combine_us(8, 8, 3000.0) == 0.0  # one chunk a row: no combine launch
    assert im.combine_us(16, 8, 1000.0) == pytest.approx(24 * 64 * 512 * 2 / 1e6)


def test_only_the_default_launchs_records_are_read(tmp_path):
    def rec(**p):
        params = dict(batch=16, prefix=4096, tree=33, impl="gluon_seesaw", persistent="default", chunk_rule="balanced",
                      table_len=4129, combine="launch", config="default")
        params.update(p)
        return json.dumps(dict(name="mla_attention", params=params, ms=1.0, floor_ms=0.5, copy_bw_GBps=3000.0))
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([
        rec(),
        rec(prefix=1024, table_len=131072),  # a serving table's chunk slots
        rec(prefix=1024, combine="last"),
        rec(prefix=1024, impl="gluon"),
        rec(prefix=1024, chunk_rule="legacy"),
        rec(prefix=1024, batch=1),
        rec(prefix=32768, config={"c_min": 1024}, impl="auto"),
    ]) + "\n")
    cases = im.load_cases([str(path)], 16)
    assert [(c["prefix"], c["c_min"], c["us"]) for c in cases] == [(4096, 512, 1000.0), (32768, 1024, 1000.0)]
