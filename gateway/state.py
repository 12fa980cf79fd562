"""What one gateway process holds: its configuration, tokenizer and chat template, the verifier it
talks to (and what that verifier accepts), admission control, sessions and metrics.

The verifier's limits (vocabulary, EOS ids, max budget, context length) are learned from its Info RPC
once it serves; until then, and while draining, requests are UNAVAILABLE (HTTP 503).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from dataclasses import dataclass

from prometheus_client import Gauge

from gateway.admission import Admission
from gateway.chat import ChatTemplate, template_for
from gateway.errors import GatewayError
from gateway.params import Defaults, Limits
from gateway.sessions import SessionStore
from gateway.text_tokenizer import TextTokenizer, chat_stop_ids
from gateway.verifier_client import VerifierClient, VerifierModel
from telemetry.metrics import Metrics, parse_hostport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    listen: str
    http_listen: str | None
    verifier_address: str
    tokenizer_dir: str
    model_name: str | None = None  # None = the verifier's model name
    max_queue: int = 256
    max_concurrency: int = 0  # 0 = the verifier's max_sessions
    max_sessions: int = 1024
    session_idle_timeout_s: float = 900.0
    default_max_tokens: int = 256
    default_draft_budget: int = 16
    default_draft_topk: int = 8
    metrics_listen: str | None = None
    api_key: str | None = None  # from DDTREE_API_KEY (read by the CLI only)
    max_message_bytes: int = 64 << 20
    grace_s: float = 30.0

    def __post_init__(self):
        if self.max_queue < 0 or self.max_concurrency < 0:
            raise ValueError(f"gateway: max_queue and max_concurrency must be >= 0, got {self.max_queue}, "
                             f"{self.max_concurrency}")
        if self.max_sessions < 1 or self.session_idle_timeout_s <= 0:
            raise ValueError("gateway: max_sessions must be >= 1 and the session idle timeout positive")
        if self.grace_s < 0 or self.max_message_bytes <= 0:
            raise ValueError("gateway: the grace period must be >= 0 and the message size positive")
        if self.api_key is not None and not self.api_key:
            raise ValueError("gateway: an empty API key would accept anyone; leave DDTREE_API_KEY unset instead")
        if self.metrics_listen is not None:
            parse_hostport(self.metrics_listen)  # ValueError naming the expected form, before anything starts
        Defaults(self.default_max_tokens, self.default_draft_budget, self.default_draft_topk)  # validates


class GatewayState:
    def __init__(self, cfg: GatewayConfig, tokenizer: TextTokenizer, verifier: VerifierClient, metrics: Metrics):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.template: ChatTemplate | None = template_for(
            tokenizer.chat_template, lambda c: tokenizer.special_id(c) is not None, tokenizer.bos_token,
            tokenizer.eos_token)
        self.chat_stop_ids = chat_stop_ids(tokenizer)
        self.verifier = verifier
        self.metrics = metrics
        self.defaults = Defaults(cfg.default_max_tokens, cfg.default_draft_budget, cfg.default_draft_topk)
        self.sessions = SessionStore(cfg.max_sessions, cfg.session_idle_timeout_s)
        self.vmodel: VerifierModel | None = None
        self.limits: Limits | None = None
        self.admission: Admission | None = None
        self.model_name = cfg.model_name or ""
        self.created = int(time.time())
        self.draining = False
        self.verifier_ready = False
        self._tasks: set[asyncio.Task] = set()
        self.sessions_gauge = _gauge(metrics, "ddtree_gateway_sessions", "Multi-turn sessions held by the gateway")
        self.running_gauge = _gauge(metrics, "ddtree_gateway_running_requests", "Requests generating now")

    def attach(self, vmodel: VerifierModel) -> None:
        """The verifier serves: learn its limits and open admission."""
        self.vmodel = vmodel
        self.limits = Limits(vmodel.vocab_size, vmodel.max_budget, vmodel.max_session_len, vmodel.eos_token_ids)
        if not self.model_name:
            self.model_name = vmodel.model
        if self.tokenizer.vocab_size > vmodel.vocab_size:
            log.warning("the tokenizer has %d ids but the model only %d", self.tokenizer.vocab_size,
                        vmodel.vocab_size)
        running = self.cfg.max_concurrency or vmodel.max_sessions
        self.admission = Admission(running, self.cfg.max_queue, self._admission_changed)
        self.verifier_ready = True

    def _admission_changed(self, running: int, queued: int) -> None:
        self.metrics.queue_depth.set(queued)
        self.running_gauge.set(running)

    def ready_limits(self) -> Limits:
        if self.draining:
            raise GatewayError("UNAVAILABLE", "the gateway is shutting down; retry on another replica")
        if self.limits is None:
            raise GatewayError("UNAVAILABLE", f"the verifier at {self.cfg.verifier_address} is not serving yet")
        return self.limits

    def check_model(self, name: str | None) -> None:
        if name and name != self.model_name:
            raise GatewayError("NOT_FOUND", f"model: {name!r} is not served here (this gateway serves "
                                            f"{self.model_name!r})", "model")

    def spawn(self, coro) -> None:
        """Run a background coroutine, keeping a reference until it ends."""
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def update_gauges(self) -> None:
        self.sessions_gauge.set(len(self.sessions))


_GAUGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # registry -> {name: Gauge}


def _gauge(metrics: Metrics, name: str, doc: str) -> Gauge:
    """A gateway-only gauge on the metrics' registry (registered once per registry)."""
    gauges = _GAUGES.setdefault(metrics.registry, {})
    if name not in gauges:
        gauges[name] = Gauge(name, doc, registry=metrics.registry)
    return gauges[name]
