"""The stack around the model: the Redis server and the streams' timing, the gateway's HTTP server,
and `jaxstream up`'s supervision of the services."""

from __future__ import annotations

from dataclasses import dataclass

from jaxstream.config.errors import require

@dataclass
class RedisConfig:
    """The Redis server every service talks through, and the streams' timing."""

    url: str | None = None
    """The Redis server's URL; null: `jaxstream up` starts an embedded redis-server."""
    namespace: str = "jaxstream"
    """Prefix of every key, so stacks can share one Redis."""
    block_ms: int = 1000
    """Longest blocking read: a service loop waiting for messages turns at least this often.

    Blocking reads and a service loop's publishes have no socket timeout (a process that stalls
    must find its reply when it resumes: jaxstream/transport/client.py); other commands time out
    after this plus 5 s."""
    stream_maxlen: int = 10000
    """Approximate cap per stream (a memory bound, not a queue limit)."""
    heartbeat_ms: int = 1000
    """How often each service says it is alive (with its stats)."""
    heartbeat_ttl_ms: int = 10000
    """A service silent this long is dead: the requests it held fail, its entries are reclaimed.

    Long enough that a stall (a GC pause, a loaded 2-core machine) fails nothing; `jaxstream up`
    sees a dead child at once and says so in Redis itself, without waiting for this."""
    reclaim_idle_ms: int = 60000
    """Backstop: entries pending this long are reclaimed whoever holds them."""
    max_deliveries: int = 3
    """An entry delivered more often goes to the dead-letter stream."""

    def __post_init__(self) -> None:
        require(bool(self.namespace), "redis.namespace", "must not be empty")
        for key in ("block_ms", "stream_maxlen", "heartbeat_ms", "heartbeat_ttl_ms", "reclaim_idle_ms",
                    "max_deliveries"):
            value = getattr(self, key)
            require(value >= 1, f"redis.{key}", f"must be >= 1, got {value}")
        require(
            self.heartbeat_ttl_ms > self.heartbeat_ms,
            "redis.heartbeat_ttl_ms",
            f"({self.heartbeat_ttl_ms}) must exceed redis.heartbeat_ms ({self.heartbeat_ms})",
        )


LOGPROBS_MODES = ("sampling", "raw", "processed")

# What an override of a secret gets told instead of "unknown key" (the issue and other servers
# name them server.api_key; the value of such an override must not land in argv or a log).
SECRET_SOURCES = {
    "server.api_key": "set $JAXSTREAM_API_KEY, or server.api_key_file=<a file holding it>",
    "server.admin_api_key": "set $JAXSTREAM_ADMIN_API_KEY, or server.admin_api_key_file=<a file holding it>",
}


@dataclass
class ServerConfig:
    """The gateway's HTTP server."""

    host: str = "127.0.0.1"
    """The address the gateway listens on."""
    port: int = 8000
    """The gateway's HTTP port."""
    # The keys themselves are never config values (jaxstream/keys.py): `jaxstream up` passes
    # overrides as arguments, which `ps` shows. They come from $JAXSTREAM_API_KEY and
    # $JAXSTREAM_ADMIN_API_KEY, or from the files below.
    api_key_file: str | None = None
    """A file whose first line is the user key (else $JAXSTREAM_API_KEY); null and unset: generation routes are open.

    The user key (OpenAI's `Authorization: Bearer <key>`, or `x-api-key: <key>`) opens every /v1
    route and the native generation and (de)tokenization routes. Without an admin key it opens the
    admin routes too, as SGLang's api_key does (gateway/auth.py)."""
    admin_api_key_file: str | None = None
    """A file whose first line is the admin key (else $JAXSTREAM_ADMIN_API_KEY); null and unset: admin routes take the user key.

    The admin key opens every route that changes state or reveals configuration: aborts, cache
    flush, pause and continue, weight updates and versions, memory release and resume, server info,
    the checkpoint's tensor names; and every user route as well."""
    health_needs_key: bool = False
    """/health, /health_generate, /metrics and /stats want the user key too (open by default, for probes and Prometheus)."""
    logprobs_mode: str = "sampling"
    """Which logprobs are returned: "sampling", "raw" or "processed" (a request's `logprobs_mode` overrides it).

    "sampling", those of the distribution that sampled, after penalties, logit bias and
    temperature, before top-k/top-p/min-p (SGLang's definition); "raw", the model's raw logits'
    (vLLM's default); "processed", after the top-k/top-p/min-p cut too, renormalized (vLLM's
    processed_logprobs)."""
    health_generate_timeout_s: float = 20.0
    """/health_generate answers 503, and aborts its one-token generation, after this long (SGLang's 20 s)."""
    max_body_bytes: int = 32 * 1024 * 1024
    """The largest request body, in bytes; a larger one is a 413, refused while it is read (never read whole first)."""
    max_chars_per_token: int = 256
    """The most characters one token can stand for: a prompt longer than the context (max_model_len tokens) times this is refused at once.

    Such a prompt cannot fit, so it is refused (400, context_length_exceeded) before any tokenizer
    works on it: a text prompt at the gateway, a chat once its template is rendered (a template may
    drop text, so the messages alone do not tell). Not for a request with truncate_prompt_tokens,
    which keeps what fits. Safe while no vocabulary entry is longer: a byte-level BPE (SmolLM2's,
    Llama 3's, Qwen's) makes each character at least one byte and each token one vocabulary entry of
    bytes; the tokenizer warns at start-up when its vocabulary holds a longer entry. A normalizer
    that merges characters (Qwen's NFC: a letter and its combining accent into one) lets a token
    stand for a few times more: keep this well above the longest entry (SmolLM2's is far below)."""
    header_timeout_s: float = 10.0
    """A request's headers must arrive whole within this many seconds of the connection (or of the request's first byte on a kept-alive one), else it is closed.

    uvicorn has no such limit: a client that sends its headers a byte at a time would hold its
    connection for ever. Refused with a 408 and the connection closed, as nginx's client_header_timeout."""
    body_timeout_s: float = 30.0
    """The longest wait for the next part of a request's body; longer is a 408, and the connection is closed.

    Between two reads, as nginx's client_body_timeout: a large upload over a slow link goes on as
    long as its bytes keep coming; a client that stops sending is cut."""
    max_json_depth: int = 128
    """The deepest nesting of arrays and objects a request body may have; deeper is a 400.

    Twice what the deepest real requests reach (a JSON schema of 30 nested objects takes about 64
    levels), and far below Python's recursion limit of 1000, which whatever walks the body after the
    gateway (json.dumps of a schema, msgspec, llguidance's schema compiler) would otherwise hit."""
    max_stop_strings: int = 64
    """The most `stop` strings one request may give (the detokenizer searches each after every token)."""
    max_stop_string_chars: int = 1024
    """The longest `stop` string, in characters (the detokenizer holds back that much text while streaming)."""
    max_stop_token_ids: int = 128
    """The most `stop_token_ids` one request may give (vLLM's limit, MAX_NUM_STOP_TOKEN_IDS)."""
    max_logit_bias: int = 1024
    """The most `logit_bias` entries one request may give (vLLM's limit, MAX_NUM_LOGIT_BIAS_TOKENS)."""
    responses_store_size: int = 256
    """How many stored Responses (`store`, true by default) a gateway keeps, for GET and previous_response_id; the least recently used go first.

    In that gateway's memory: with several gateways a response is retrieved through the one that
    made it, and a restart forgets them (docs/api.md, Responses)."""
    max_logprobs: int = 20
    """The most logprob alternatives a request may ask per token, generated or prompt (vLLM's --max-logprobs); -1: the whole vocabulary.

    A request asking more is refused in vLLM's words; `top_logprobs`/`prompt_logprobs` -1 asks for
    the whole vocabulary. Above 20 the worker compiles a second, wider sampler and prompt scorer
    at start-up, run only in a step where some request asks past 20 (the others' steps never
    pay for it); each alternative costs its id and logprob on the wire, and its text."""
    scheduler_stall_s: float = 60.0
    """A live scheduler waiting this long for a step result is stalled: /health answers 503 naming it, `jaxstream up` restarts its replica.

    So is one that leaves the messages of its streams unhandled this long. Far longer than any step
    runs (one that compiles a new shape included): a heartbeat says the process runs, this says it
    does its work (jaxstream/transport/liveness.py). Its requests end with an error as the replica
    restarts. Longer than redis.heartbeat_ttl_ms, so a process that is merely stopped is dead first."""
    detokenizer_stall_s: float = 30.0
    """A live detokenizer leaving results unhandled this long is stalled: /health answers 503 naming it, `jaxstream up` restarts it.

    Its requests end with an error as it restarts, as for a detokenizer that died."""
    drain_timeout_s: float = 30.0
    """On SIGTERM the gateway refuses new requests (503, Retry-After) and waits this long at most for those in flight.

    What compose and Kubernetes send before they stop a container: requests running finish (up to
    this long; the rest then end with an error), /health answers 503 "draining" meanwhile, so a load
    balancer sends elsewhere. A second signal stops it at once. 0: stop at once."""

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "server.port", f"must be in 0..65535, got {self.port}")
        for name in ("max_body_bytes", "max_json_depth", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids",
                     "max_logit_bias", "responses_store_size"):
            require(getattr(self, name) >= 1, f"server.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.max_logprobs >= -1, "server.max_logprobs", f"must be -1 (the whole vocabulary) or >= 0, got {self.max_logprobs}")
        require(self.logprobs_mode in LOGPROBS_MODES, "server.logprobs_mode",
                f"must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        require(self.health_generate_timeout_s > 0, "server.health_generate_timeout_s",
                f"must be > 0, got {self.health_generate_timeout_s}")
        require(self.max_chars_per_token >= 1, "server.max_chars_per_token", f"must be >= 1, got {self.max_chars_per_token}")
        for name in ("header_timeout_s", "body_timeout_s"):
            require(getattr(self, name) > 0, f"server.{name}", f"must be > 0, got {getattr(self, name)}")
        require(self.drain_timeout_s >= 0, "server.drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        for name in ("scheduler_stall_s", "detokenizer_stall_s"):
            require(getattr(self, name) > 0, f"server.{name}", f"must be > 0, got {getattr(self, name)}")

    def stall_limits(self) -> dict[str, float]:
        """By role, how long a live instance may hold work without doing it (jaxstream/transport/liveness.py)."""
        return {"scheduler": self.scheduler_stall_s, "detokenizer": self.detokenizer_stall_s}



RESTART_POLICIES = ("always", "never")


@dataclass
class SupervisorConfig:
    """`jaxstream up`'s supervision of the services it starts."""

    restart: str = "always"
    """What `jaxstream up` does when a service dies: "always" restarts it, "never" stops the whole stack (`--restart=never`).

    A gateway, tokenizer or detokenizer restarts alone; a replica's scheduler and worker restart
    together (the requests they held fail first); the embedded Redis restarts on its port, and the
    services reconnect."""
    max_restarts: int = 5
    """A service that dies more often than this within restart_window_s is in a crash loop: the stack stops, naming it."""
    restart_window_s: float = 60.0
    """The window over which max_restarts counts; restarts back off (0.5, 1, 2, 4, 8 s) within it."""
    start_report_s: float = 30.0
    """Until the stack is ready, `jaxstream up` says this often which services are not up, with their last start-up phase.

    At start and while it heals: a start that cannot finish says so instead of waiting silently."""

    def __post_init__(self) -> None:
        require(self.restart in RESTART_POLICIES, "supervisor.restart", f"must be one of {RESTART_POLICIES}, got {self.restart!r}")
        require(self.max_restarts >= 1, "supervisor.max_restarts", f"must be >= 1, got {self.max_restarts}")
        require(self.restart_window_s > 0, "supervisor.restart_window_s", f"must be > 0, got {self.restart_window_s}")
        require(self.start_report_s > 0, "supervisor.start_report_s", f"must be > 0, got {self.start_report_s}")
