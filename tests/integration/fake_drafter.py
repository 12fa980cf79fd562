"""Test drafters behind the real drafter service (`python -m tests.integration.fake_drafter ...`).

    --oracle FILE        propose each session's known continuation (JSON {session_id: tokens}), with
                         controlled corruption (tests.helpers.OracleDrafter): deep acceptance over the wire
    --corrupt SUBSTRING  build real trees, then break the tree of every session whose id contains
                         SUBSTRING (node n-1 names itself as parent): the verifier must fail only those
Every other flag is `ddtree drafter serve`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from drafter_service.drafter import Drafter
from tests.helpers import OracleDrafter


def make_drafter_class(oracle: dict | None, corrupt: str | None):
    class TestDrafter(Drafter):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.oracle = None
            if oracle is not None:
                self.oracle = OracleDrafter(oracle, self.cfg.vocab_size, self.cfg.block_size, p_wrong=0.2, seed=0)

        def draft_logq(self, requests):
            # the service namespaces ids as "<stream>/<sid>"; the oracle knows plain ids
            plain = [dataclasses.replace(r, session_id=r.session_id.split("/", 1)[-1]) for r in requests]
            if self.oracle is None or any(r.session_id not in self.oracle.reference for r in plain):
                return super().draft_logq(requests)  # the warm-up step
            return self.oracle.draft_logq(plain).to(self.device)

        @torch.no_grad()
        def draft(self, requests):
            trees = super().draft(requests)
            for j, r in enumerate(requests):
                n = trees.n_nodes[j]
                if corrupt and corrupt in r.session_id and n >= 2:
                    trees.parent[j, n - 1] = n - 1
            return trees

    return TestDrafter


def main(argv: list[str]) -> int:
    from gateway.cli import build_parser
    from gateway.commands import drafter as drafter_cmd

    own = argparse.ArgumentParser()
    own.add_argument("--oracle", default=None)
    own.add_argument("--corrupt", default=None)
    mine, rest = own.parse_known_args(argv)
    oracle = json.loads(open(mine.oracle).read()) if mine.oracle else None
    args = build_parser().parse_args(["drafter", "serve", *rest])
    return drafter_cmd.run(args, make_drafter=make_drafter_class(oracle, mine.corrupt))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
