"""Observability shared by the gateway, verifier and drafter services.

- `telemetry.metrics`: Prometheus metrics (names prefixed `ddtree_`), a per-process registry and
  the exposition helpers (a standalone HTTP server for `--metrics-listen`, and a renderer the
  gateway mounts at `/metrics`).
- `telemetry.tracing`: OpenTelemetry setup from the standard `OTEL_*` variables, W3C trace-context
  propagation over grpc.aio metadata and HTTP headers, and span helpers with GenAI
  semantic-convention attribute names.

Nothing here reads the environment by itself: the CLI passes `os.environ` in (DESIGN 1).
"""
