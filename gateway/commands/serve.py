"""`ddtree serve`: drafter, verifier and gateway co-located on this machine, in one command.

    ddtree serve [--target DIR --drafter DIR] [--host H] [--port P] [--http-port Q]

Starts three child processes (`ddtree drafter serve`, `ddtree verifier serve` with the co-located
transport, `ddtree gateway serve`): the drafter and the verifier on free loopback ports, the gateway on
H:P (gRPC) and H:Q (OpenAI HTTP). Without --target/--drafter it serves the committed pair under
models/ when present, else the random `tiny` preset written to a cache folder (the mechanics only).
When all three serve it prints one JSON line `{"event": "serving", "grpc": ..., "http": ..., ...}`
and a readable summary on stderr. Ctrl-C or SIGTERM stops them in order (gateway first, so its
in-flight streams drain, then verifier and drafter); if one dies, the others are stopped and the
command exits 1. DDTREE_API_KEY and OTEL_* pass to the children through the environment.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

STOP_TIMEOUT_S = 60.0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="run gateway, verifier and drafter co-located on this machine")
    p.add_argument("--target", default=None, help="target checkpoint folder (default: models/ pair or tiny random)")
    p.add_argument("--drafter", default=None, help="DFlash drafter folder (with --target)")
    p.add_argument("--host", default="127.0.0.1", help="interface the gateway listens on")
    p.add_argument("--port", type=int, default=50050, help="gateway gRPC port (0 = any free port)")
    p.add_argument("--http-port", type=int, default=8080, help="gateway OpenAI HTTP port (0 = any free port)")
    p.add_argument("--device", default=None, help="torch device for verifier and drafter (default: cuda if any)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | float64")
    p.add_argument("--max-queue", type=int, default=256, help="gateway admission queue")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=run)


def model_pair(args) -> tuple[Path, Path, str | None]:
    """(target, drafter, note): the flags, else models/kimi-mini, else the cached tiny random pair."""
    if (args.target is None) != (args.drafter is None):
        raise ValueError("--target and --drafter go together (or leave both out for the default pair)")
    if args.target is not None:
        return Path(args.target), Path(args.drafter), None
    from gateway.commands.demo import _fallback_pair, default_pair

    pair = default_pair()
    if (pair / "target" / "config.json").exists() and (pair / "drafter" / "config.json").exists():
        return pair / "target", pair / "drafter", None
    pair = _fallback_pair()
    return pair / "target", pair / "drafter", "no models/ pair: serving a random tiny pair (the mechanics only)"


class Child:
    """One `ddtree ...` child process and the JSON lifecycle events it prints."""

    def __init__(self, name: str, argv: list[str]):
        self.name, self.argv = name, argv
        self.proc: asyncio.subprocess.Process | None = None
        self.events: dict[str, dict] = {}
        self._changed = asyncio.Event()
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gateway.cli", *self.argv,
                                                         stdout=asyncio.subprocess.PIPE)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict) and "event" in ev:
                self.events[ev["event"]] = ev
                self._changed.set()
        self._changed.set()

    async def wait_event(self, event: str) -> str:
        while event not in self.events:
            if self.proc.returncode is not None or self.proc.stdout.at_eof():
                raise RuntimeError(f"{self.name} exited before {event!r} (status {self.proc.returncode})")
            self._changed.clear()
            await self._changed.wait()
        return self.events[event]["address"]

    async def stop(self) -> int | None:
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


async def _serve(args, target: Path, drafter: Path) -> int:
    dev = [*(["--device", args.device] if args.device else []), *(["--dtype", args.dtype] if args.dtype else [])]
    log = ["--log-level", args.log_level]
    children: list[Child] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        d = Child("drafter", ["drafter", "serve", "--listen", "127.0.0.1:0", "--target", str(target),
                              "--drafter", str(drafter), *dev, *log])
        children.append(d)
        await d.start()
        v = Child("verifier", ["verifier", "serve", "--listen", "127.0.0.1:0", "--target", str(target),
                               "--drafter-address", await _or_stop(d.wait_event("listening"), stop), *dev, *log])
        children.append(v)
        await v.start()
        g = Child("gateway", ["gateway", "serve", "--listen", f"{args.host}:{args.port}", "--http-listen",
                              f"{args.host}:{args.http_port}", "--verifier-address",
                              await _or_stop(v.wait_event("listening"), stop), "--tokenizer", str(target),
                              "--max-queue", str(args.max_queue), *log])
        children.append(g)
        await g.start()
        for c in children:
            await _or_stop(c.wait_event("serving"), stop)
        info = {"event": "serving", "grpc": g.events["serving"]["address"],
                "http": g.events["http_listening"]["address"], "verifier": v.events["serving"]["address"],
                "drafter": d.events["serving"]["address"], "target": str(target), "drafter_dir": str(drafter)}
        print(json.dumps(info), flush=True)
        print(f"ddtree serve: gateway gRPC {info['grpc']}, OpenAI HTTP http://{info['http']}/v1 "
              f"(verifier {info['verifier']}, drafter {info['drafter']}); Ctrl-C stops all three", file=sys.stderr)
        died = [asyncio.ensure_future(c.proc.wait()) for c in children]
        stopper = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait([stopper, *died], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        code = 0 if stopper in done else 1
        if code:
            gone = [c.name for c in children if c.proc.returncode is not None]
            print(f"ddtree serve: {', '.join(gone)} exited; stopping the others", file=sys.stderr)
        return code
    except _Stopped:
        return 0
    except RuntimeError as e:
        print(f"ddtree serve: {e}", file=sys.stderr)
        return 1
    finally:
        for c in reversed(children):  # gateway, then verifier, then drafter
            await c.stop()
        print(json.dumps({"event": "stopped"}), flush=True)


class _Stopped(Exception):
    pass


async def _or_stop(aw, stop: asyncio.Event):
    """Await `aw` unless a stop signal comes first (then raise _Stopped)."""
    task, stopper = asyncio.ensure_future(aw), asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task not in done:
        task.cancel()
        raise _Stopped
    return task.result()


def run(args) -> int:
    for name in ("port", "http_port"):
        if not 0 <= getattr(args, name) < 65536:
            raise ValueError(f"--{name.replace('_', '-')} must be a port number, got {getattr(args, name)}")
    target, drafter, note = model_pair(args)
    for folder in (target, drafter):
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json (not a model folder)")
    if note:
        print(f"ddtree serve: {note}", file=sys.stderr)
    return asyncio.run(_serve(args, target, drafter))
