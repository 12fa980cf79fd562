"""The line-up of `bench_transport.py`: the drafter process it measures against (`ddtree drafter serve` on loopback,
its announcements and its graph-run counters), the remote transports and their stream clients' settings, the
`--variant` specs, and the engines built from them on one shared target."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def drafter_trace_spec(spec: str, steps_per_round: int) -> str:
    """`--torch-trace DIR:FIRST:COUNT` (in rounds) -> the drafter process's window in its own steps: it counts every
    step it is sent, `steps_per_round` a round (each remote engine's block), so both windows cover the same
    rounds."""
    from telemetry.torch_trace import parse_spec

    out, first, count = parse_spec(spec)
    return f"{out}:{first * steps_per_round}:{count * steps_per_round}"


def start_drafter(pair, device, dtype, max_sessions, graphs: bool, spin_ms: float, torch_trace: str | None,
                  gil_switch_us: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "drafter", "serve", "--listen", "127.0.0.1:0",
                             "--target", str(pair / "target"), "--drafter", str(pair / "drafter"), "--device", device,
                             "--dtype", dtype, "--max-sessions", str(max_sessions), "--log-level", "WARNING",
                             "--control-spin-ms", str(spin_ms), "--metrics-listen", "127.0.0.1:0",
                             "--gil-switch-us", str(gil_switch_us),
                             *([] if graphs else ["--no-cuda-graphs"]),
                             *([] if torch_trace is None else ["--torch-trace", torch_trace])],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)


def wait_serving(proc: subprocess.Popen) -> tuple[str, str | None]:
    """-> (the drafter's gRPC address, its metrics address) from its announcements."""
    metrics = None
    for line in proc.stdout:
        ev = json.loads(line)
        if ev.get("event") == "metrics_listening":
            metrics = ev["address"]
        if ev.get("event") == "serving":
            return ev["address"], metrics
    raise RuntimeError(f"the drafter did not start (exit status {proc.wait()})")


def graph_runs(metrics_addr: str | None) -> dict[str, int]:
    """The drafter process's `ddtree_draft_graph_runs_total` by kind (replays, captures, eager, ...; context_* for
    appends), scraped from its metrics endpoint; {} without one."""
    if metrics_addr is None:
        return {}
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{metrics_addr}/", timeout=10) as r:
        text = r.read().decode()
    return {s.labels["kind"]: int(s.value) for fam in text_string_to_metric_families(text)
            if fam.name == "ddtree_draft_graph_runs" for s in fam.samples if s.name.endswith("_total")}


@dataclasses.dataclass(frozen=True)
class Variant:
    """`--variant FIELD=VALUE[,...][@ENGINE[/ENGINE]]`: a copy of the engines named (all: None) with these EngineConfig
    fields changed, and with `rows` ("projected" / "taps"), the context rows its remote copies send."""

    suffix: str  # "+FIELD=VALUE,...": appended to the engine's name
    cfg: object  # the EngineConfig
    rows: str | None
    engines: frozenset[str] | None

    @classmethod
    def parse(cls, spec: str, base) -> Variant:
        fields, _, names = spec.partition("@")
        changes, rows = {}, None
        for item in fields.split(","):
            key, eq, value = item.partition("=")
            if not eq or not value:
                raise ValueError(f"--variant {spec!r}: {item!r} is not FIELD=VALUE")
            if key == "rows":
                if value not in ("projected", "taps"):
                    raise ValueError(f"--variant {spec!r}: rows must be projected or taps")
                rows = value
                continue
            if key not in {f.name for f in dataclasses.fields(base)}:
                raise ValueError(f"--variant {spec!r}: {key!r} is not an EngineConfig field")
            changes[key] = cls._value(spec, key, getattr(base, key), value)
        cfg = dataclasses.replace(base, **changes)  # EngineConfig checks the values
        return cls("+" + fields, cfg, rows, frozenset(names.split("/")) if names else None)

    @staticmethod
    def _value(spec: str, key: str, old, value: str):
        """A field's new value in the type of its old one (a flag, bool or None, takes true/false/on/off)."""
        if isinstance(old, bool) or old is None:
            flags = {"true": True, "on": True, "false": False, "off": False}
            if value.lower() not in flags:
                raise ValueError(f"--variant {spec!r}: {key} takes true or false, got {value!r}")
            return flags[value.lower()]
        try:
            return type(old)(value)
        except ValueError:
            raise ValueError(f"--variant {spec!r}: {key} takes a {type(old).__name__}, got {value!r}") from None

    def takes(self, engine: str) -> bool:
        return self.engines is None or engine in self.engines


def kind(engine: str) -> str:
    """An engine's transport: its name without a variant's suffix (colocated+tree_inputs=torch -> colocated)."""
    return engine.split("+", 1)[0]


IN_PLACE = {"colocated_in_place": "on", "colocated_answer": "off"}  # StreamClientConfig.trees_in_place (else auto)

# co-located engines with events and the doorbell; colocated_polled: without the request doorbell (the drafter polls
# our request event on its host before it launches an ahead step's draft)
DOORBELLED = ("colocated", "colocated_in_place", "colocated_answer", "colocated_polled")


def keepwarm_ms(transport: str, args) -> float:
    """The keep-warm period of an engine's stream client (grpc_cold: none; co-located streams never send any)."""
    return 0.0 if transport in ("inprocess", "grpc_cold") else args.keepwarm_ms


def remote_transports(args, cuda: bool, p: argparse.ArgumentParser) -> tuple[str, ...]:
    """The remote engines to run: all by default (on a GPU also the co-located stream without the trees doorbell, the
    verifier polling the drafter's IPC event on its host, and without IPC events, each side waiting for its GPU before
    each message; gRPC without its keep-warm messages, grpc_cold, everywhere), or those --transports names."""
    remote = (*DOORBELLED, "colocated_events", "colocated_sync", "grpc", "grpc_sync", "grpc_cold") if cuda \
        else ("colocated", "grpc", "grpc_cold")
    if args.transports is not None:
        if unknown := set(args.transports) - set(remote):
            p.error(f"--transports: {sorted(unknown)} not among {list(remote)} on {args.device}")
        remote = tuple(t for t in remote if t in args.transports)
    return remote


def open_engines(args, inproc, projector, ecfg, variants: dict[str, Variant], remote: tuple[str, ...], addr: str,
                 clients: dict) -> dict[str, object]:
    """-> every engine by name: the in-process one, its variants' copies, and for each remote transport (and variant
    taking it) an engine on the in-process engine's target whose drafter is a stream to the drafter process at `addr`
    (sending rows projected by `projector` where they are to be projected). The streams go into `clients` as they
    open, for the caller to close."""
    from drafter_service.drafter import Drafter
    from verifier_service.engine import Engine
    from verifier_service.transport import StreamClientConfig
    from verifier_service.transport_stream import DraftStreamClient

    engines = {"inprocess": inproc}
    for suffix, v in variants.items():  # the in-process engine again, with a drafter state of its own
        if v.takes("inprocess"):
            d = inproc.drafter
            engines["inprocess" + suffix] = Engine(
                inproc.target, Drafter(d.model, d.embed_weight, d.lm_head_weight, max_sessions=v.cfg.max_sessions,
                                       window=v.cfg.draft_window, cuda_graphs=v.cfg.cuda_graphs),
                inproc.tap_layers, v.cfg, inproc.projection)
    for name in (t + suffix for suffix in ("", *variants) for t in remote if not suffix or variants[suffix].takes(t)):
        transport, suffix = kind(name), name[len(kind(name)):]
        sends = variants[suffix].rows if suffix and variants[suffix].rows else args.rows
        projection = projector if sends == "projected" or (sends == "auto" and transport.startswith("grpc")) \
            else None
        client = DraftStreamClient(StreamClientConfig(addr, colocated=not transport.startswith("grpc"),
                                                      region_device=args.device, draft_timeout_s=60,
                                                      ipc_events=transport in (*DOORBELLED, "colocated_events"),
                                                      doorbell=transport in (*DOORBELLED, "grpc", "grpc_cold"),
                                                      trees_in_place=IN_PLACE.get(transport, "auto"),
                                                      request_doorbell=transport != "colocated_polled",
                                                      control_spin_s=args.control_spin_ms / 1e3,
                                                      check_graphs=args.check_graphs,
                                                      keepwarm_ms=keepwarm_ms(transport, args),
                                                      client_id=f"bench-{name}",
                                                      context_projection=projection.fingerprint
                                                      if projection is not None else ""))
        client.start()
        model = client.wait_ready(timeout=120)
        clients[name] = client
        # one target for all: the in-process engine's (batch-invariant on CUDA), so only the drafter path differs
        engines[name] = Engine(inproc.target, client, model.target_layer_ids,
                               variants[suffix].cfg if suffix else ecfg, projection)
    return engines
