"""The drafter's context projection held by the verifier (`drafter_service.context_projection`).

It must compute what the drafter computes from the taps (so a projected row drafts exactly what its taps draft),
load from the drafter's checkpoint layouts and name its weights (the fingerprint a drafter checks at stream open);
the engine sends projected rows when it holds it; over the stream the rows cross projected (the drafter's hidden
size, not num_taps x the target's), a projection the drafter does not share is refused and the verifier drafts
autoregressively, and a row of the wrong width fails only its session.
"""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
import torch

from drafter_service.api import DraftRequest
from drafter_service.checkpoint import write_random_drafter
from drafter_service.context_projection import ContextProjection
from drafter_service.drafter import Drafter
from protos.ddtree.v1 import drafter_pb2, drafter_pb2_grpc
from tests.unit.stream_harness import (
    assert_same_trees,
    client_for,
    feats,
    root_only,
    steps,
)
from verifier_service import draft_call, presets
from verifier_service.safetensors_io import CheckpointError, write_sharded
from verifier_service.session import DecodeParams
from verifier_service.transport import StreamClientConfig
from verifier_service.transport_stream import DraftStreamClient


def projected(reqs, proj):
    """The requests with their rows projected as the engine projects a step's: all of them in one GEMM."""
    rows = proj(torch.cat([r.ctx_features for r in reqs])).split([r.ctx_features.shape[0] for r in reqs])
    return [dataclasses.replace(r, ctx_features=f, ctx_projected=True) for r, f in zip(reqs, rows, strict=True)]


def test_the_projection_is_the_drafters_own_computation(parts):
    model = parts[0]
    proj = ContextProjection.from_model(model)
    assert proj.fc is model.fc and proj.hidden_norm is model.hidden_norm  # shared, no second copy
    taps = feats(5, seed=1, F=proj.in_features)
    rows = proj(taps)
    assert rows.shape == (5, model.cfg.hidden_size) and torch.equal(rows, model.project(taps))
    pos = torch.arange(3, 8)
    for (k, v), (k2, v2) in zip(model.context_kv(taps, pos), model.context_kv_from(rows, pos), strict=True):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_load_reads_the_checkpoint_and_its_fingerprint_names_the_weights(tiny_dirs, parts, tmp_path):
    own = ContextProjection.from_model(parts[0])
    loaded = ContextProjection.load(tiny_dirs[1], torch.float64, "cpu")
    assert torch.equal(loaded.fc.weight, own.fc.weight)
    assert torch.equal(loaded.hidden_norm.weight, own.hidden_norm.weight)
    assert loaded.hidden_norm.eps == own.hidden_norm.eps and loaded.fc.bias is None
    taps = feats(4, seed=2, F=own.in_features)
    assert torch.equal(loaded(taps), own(taps))
    assert len(own.fingerprint) == 64 and loaded.fingerprint == own.fingerprint
    # the weights are named, not their dtype: a bf16 checkpoint loaded in bf16 has the same fingerprint
    assert ContextProjection.load(tiny_dirs[1], torch.bfloat16, "cpu").fingerprint == own.fingerprint
    hidden = json.loads((tiny_dirs[0] / "config.json").read_text())["text_config"]["hidden_size"]
    write_random_drafter(tmp_path / "prefixed", presets.drafter_config("tiny"), hidden, seed=1, prefix="model.")
    assert ContextProjection.load(tmp_path / "prefixed", torch.float64, "cpu").fingerprint == own.fingerprint
    write_random_drafter(tmp_path / "other", presets.drafter_config("tiny"), hidden, seed=2)
    assert ContextProjection.load(tmp_path / "other", torch.float64, "cpu").fingerprint != own.fingerprint
    # one weight of the sample changed: another fingerprint (a change between samples is not seen: documented)
    fc = torch.nn.Linear(own.in_features, own.out_features, bias=False).double()
    fc.weight.data.copy_(own.fc.weight)
    fc.weight.data[0, 0] += 1
    assert ContextProjection(fc, own.hidden_norm).fingerprint != own.fingerprint


def test_load_names_what_is_missing_or_misshapen(tiny_dirs, parts, tmp_path):
    cfg = (tiny_dirs[1] / "config.json").read_text()
    fc = parts[0].fc.weight.detach().to(torch.bfloat16)
    (tmp_path / "no_norm").mkdir()
    (tmp_path / "no_norm" / "config.json").write_text(cfg)
    write_sharded(tmp_path / "no_norm", {"fc.weight": fc}, 1 << 30)
    with pytest.raises(CheckpointError, match="hidden_norm.weight"):
        ContextProjection.load(tmp_path / "no_norm", torch.float32, "cpu")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(cfg)
    write_sharded(tmp_path / "bad", {"fc.weight": fc[:, :-1].contiguous(),
                                     "hidden_norm.weight": torch.ones(fc.shape[0], dtype=torch.bfloat16)}, 1 << 30)
    with pytest.raises(CheckpointError, match="fc.weight has shape"):
        ContextProjection.load(tmp_path / "bad", torch.float32, "cpu")


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_drafter_drafts_the_same_from_projected_rows_as_from_taps(parts, cuda_graphs):
    """cuda_graphs True on a CPU drafter: the padded graph path, run eagerly (its append takes projected rows)."""
    proj = ContextProjection.from_model(parts[0])
    by_taps, by_rows, mixed = (Drafter(*parts, max_sessions=4, window=16, cuda_graphs=cuda_graphs) for _ in range(3))
    for reqs in steps():
        want = by_taps.draft(reqs)
        assert_same_trees(by_rows.draft(projected(reqs, proj)), want)
        assert_same_trees(mixed.draft([reqs[0], *projected(reqs[1:], proj)]), want)  # one session each way
    # the same GEMM over the same rows: bit for bit; one session apart: another GEMM shape, the same values
    assert torch.equal(by_rows.cache.k, by_taps.cache.k) and torch.equal(by_rows.cache.v, by_taps.cache.v)
    torch.testing.assert_close(mixed.cache.k, by_taps.cache.k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mixed.cache.v, by_taps.cache.v, rtol=1e-12, atol=1e-12)


def test_the_engine_projects_what_it_sends(tiny_dirs, monkeypatch):
    from verifier_service.local import build_local_engine

    engine = build_local_engine(*tiny_dirs, torch.float64, "cpu")
    assert engine.projection is not None and engine.projection.fc is engine.drafter.model.fc
    D, seen = engine.drafter.cfg.hidden_size, []
    draft = engine.drafter.draft
    monkeypatch.setattr(engine.drafter, "draft", lambda reqs: (seen.extend(reqs), draft(reqs))[1])
    prompts = [[5, 9, 14, 3, 22, 7], [31, 8, 2]]
    dd = engine.generate(prompts, DecodeParams(max_new_tokens=24, budget=8, topk=4, ignore_eos=True))
    assert seen and all(r.ctx_projected for r in seen)
    assert all(r.ctx_features.shape[1] == D for r in seen if r.ctx_features.shape[0])
    assert sum(r.ctx_features.shape[0] for r in seen) > len(prompts)  # prompts and committed rows went
    for s in dd:
        engine.release(s.sid)
    ar = engine.generate(prompts, DecodeParams(max_new_tokens=24, budget=0, ignore_eos=True))
    assert [s.output for s in dd] == [s.output for s in ar]
    # the same engine sending taps (the drafter projects them) drafts the same trees: the same accepted paths
    engine.projection = None
    for s in ar:
        engine.release(s.sid)
    again = engine.generate(prompts, DecodeParams(max_new_tokens=24, budget=8, topk=4, ignore_eos=True))
    assert [s.accepted_per_step for s in again] == [s.accepted_per_step for s in dd]
    assert max(a for s in dd for a in s.accepted_per_step) >= 2  # some drafts were accepted at all


@pytest.mark.parametrize("colocated", [False, True])
def test_projected_rows_cross_the_stream(parts, served, colocated, monkeypatch, caplog):
    service, srv = served
    proj = ContextProjection.from_model(parts[0])
    assert service.info().context_projection == proj.fingerprint and service.info().hidden_size == proj.out_features
    sent = []
    send = draft_call.DraftCall.send
    monkeypatch.setattr(draft_call.DraftCall, "send", lambda self, msg: (sent.append(msg), send(self, msg))[1])
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, colocated, context_projection=proj.fingerprint)
    try:
        assert sent[0].open.context_projection == proj.fingerprint
        for reqs in steps():
            rows = projected(reqs, proj)
            assert_same_trees(client.draft(rows), local.draft(rows))
        assert client.take_errors() == {}
        step_msgs = [m.step for m in sent if m.WhichOneof("kind") == "step"]
        assert len(step_msgs) == 3
        for m, reqs in zip(step_msgs, steps()):  # D columns per row crossed, not num_taps x target hidden
            assert list(m.ctx_features.shape) == [sum(r.ctx_features.shape[0] for r in reqs), proj.out_features]
        # a taps-wide row on this stream fails its session only (an autoregressive step, the refusal logged with
        # what the stream takes; not the session's fault, so no error for its caller)
        bad = dataclasses.replace(steps(("c",))[0][0], ctx_projected=True)
        with caplog.at_level("INFO", logger="verifier_service.transport_stream"):
            got = client.draft([bad, *projected(steps(("d",))[0], proj)])
        assert root_only(got, 0, bad.root_token) and got.n_nodes[1] > 1
        assert client.take_errors() == {} and client.connected
        refusals = [r.getMessage() for r in caplog.records if "could not draft for c" in r.getMessage()]
        assert refusals and "INVALID_ARGUMENT" in refusals[0] and "projected context rows" in refusals[0], refusals
    finally:
        client.close()


def test_a_projection_the_drafter_does_not_share_is_refused(parts, served):
    """The client asks the drafter's Info first: another projection is a configuration error, raised by wait_ready
    (a verifier fails at start, saying which flag to fix); meanwhile every step is autoregressive, nothing raised.
    The drafter refuses such a stream itself too (FAILED_PRECONDITION), whoever opens it."""
    service, srv = served
    client = DraftStreamClient(StreamClientConfig(f"127.0.0.1:{srv.port}", retry_max_s=0.2,
                                                  context_projection="0" * 64))
    client.start()
    try:
        with pytest.raises(ValueError, match="has another context projection .* point --context-projection"):
            client.wait_ready(timeout=10)
        assert not client.connected and service.info().streams == 0
        reqs = steps()[0]
        got = client.draft(reqs)
        assert all(root_only(got, r, q.root_token) for r, q in enumerate(reqs))
    finally:
        client.close()
    with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as ch:
        call = drafter_pb2_grpc.DrafterStub(ch).Draft(iter([drafter_pb2.DraftStreamRequest(
            open=drafter_pb2.OpenStream(client_id="raw", context_projection="0" * 64))]), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            next(call)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "context projection 0000000000000000... is not this drafter's" in e.value.details()


def test_projected_rows_sent_ahead_in_context_messages(parts, served, monkeypatch):
    """With a 2 KiB message limit a step carries 1 KiB of projected rows (two fp64 rows of 64): the rest of a long
    prompt goes ahead in `context` messages, which a projected stream appends as projected rows too."""
    _, srv = served
    proj = ContextProjection.from_model(parts[0])
    sent = []
    send = draft_call.DraftCall.send
    monkeypatch.setattr(draft_call.DraftCall, "send", lambda self, msg: (sent.append(msg), send(self, msg))[1])
    local = Drafter(*parts, max_sessions=8, window=64)
    client = client_for(srv.port, False, max_message_bytes=2048, context_projection=proj.fingerprint)
    try:
        long_prompt = [DraftRequest("long", 0, feats(11, 5), 30, 11, 16, 4)]
        nxt = [DraftRequest("long", 11, feats(3, 7), 32, 14, 16, 4)]
        for reqs in (long_prompt, nxt):
            rows = projected(reqs, proj)
            assert_same_trees(client.draft(rows), local.draft(rows))
        assert client.stats["fallback_steps"] == 0 and client.take_errors() == {}
        ahead = [m.context for m in sent if m.WhichOneof("kind") == "context"]
        assert ahead and all(list(m.ctx_features.shape)[1] == proj.out_features for m in ahead)
    finally:
        client.close()
