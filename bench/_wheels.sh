# Sourced by the device scripts: the device image lacks grpcio-health-checking, grpcio-reflection and the
# opentelemetry SDK (which the transport and engine tests import). Where they are missing and `.whl/` was carried (the
# wheels, git-ignored; docs/performance.md says how to fetch them), install them into /tmp/site and put it on the path.
if ! python -c "import grpc_health, opentelemetry.sdk" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
