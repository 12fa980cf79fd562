"""bench_transport.py's `--variant` specs: EngineConfig fields in their types, rows, the engines named; bad ones
refused with a message naming the field (the bench exits 2 with it: tests/integration/test_bench_transport.py)."""

from __future__ import annotations

import pytest

from bench.transport_lineup import Variant
from verifier_service.engine import EngineConfig


def test_a_variant_spec_takes_engine_config_fields_in_their_types():
    """`--variant`: strings as they are, numbers and flags in their field's type, rows and the engines named; a
    value the field cannot take is refused with the field's name."""
    base = EngineConfig(cuda_graphs=True)
    v = Variant.parse("tree_accept=torch,cuda_graphs=off,num_pages=64,rows=taps@inprocess/grpc", base)
    assert (v.cfg.tree_accept, v.cfg.cuda_graphs, v.cfg.num_pages, v.rows) == ("torch", False, 64, "taps")
    assert v.suffix == "+tree_accept=torch,cuda_graphs=off,num_pages=64,rows=taps"
    assert v.takes("grpc") and v.takes("inprocess") and not v.takes("colocated")
    assert Variant.parse("local_draft=lazy", base).takes("colocated")
    for spec, why in (("cuda_graphs=maybe", "true or false"), ("num_pages=many", "takes a int"),
                      ("num_pages=0", "must be positive"), ("tree_accept=fast", "tree_accept must be")):
        with pytest.raises(ValueError, match=why):
            Variant.parse(spec, base)
