"""RouterSettings: every knob of the live router, built once at the edge.

Sources, highest priority first: command-line flags, `ROUTEWISE_*` environment variables,
a YAML/JSON config file (`--config`), defaults. Bad values raise a pydantic ValidationError
that names the field and the value.

The settings stay flat (the names users know as flags, variables and file keys); each component gets its own
small config of the settings it reads, built here (`replica_config()`, `scrape_config()`, ...), and never
imports this module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import ssl
from pathlib import Path
from collections.abc import Iterable
from types import MappingProxyType
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict
from yarl import URL

from routewise_vllm.router.observe.outlier import EjectionConfig
from routewise_vllm.router.observe.scraper import ScrapeConfig
from routewise_vllm.router.policy.kv_view import DEFAULT_INFLIGHT_S
from routewise_vllm.router.policy.late_binding import LateBindingConfig
from routewise_vllm.router.policy.registry import DEFAULT_POLICY, check_policy_name, is_learned
from routewise_vllm.router.paths import DEFAULT_PASSTHROUGH_PATHS, PassthroughConfig, normalise_path
from routewise_vllm.router.replicas import ReplicaConfig, replica_id  # replica_id: importable here too
from routewise_vllm.router.scale.fleet_view import FleetViewConfig, redact_url  # redact_url: here too
from routewise_vllm.router.scale.workers import WorkersConfig

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
C = TypeVar("C")


def _fill(config: type[C], settings: object, **given: Any) -> C:
    """A component's config: each field from the setting of the same name, unless `given`."""
    return config(**{f.name: given[f.name] if f.name in given else getattr(settings, f.name)
                     for f in dataclasses.fields(config)})  # type: ignore[arg-type]


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ROUTEWISE_", extra="forbid", validate_default=True,
                                      env_parse_none_str="none")

    # listener
    host: str = Field("0.0.0.0", description="listen address of the OpenAI API; 127.0.0.1 keeps it local")
    port: int = Field(8000, ge=0, le=65535, description="listen port of the OpenAI API (and of /metrics and /admin/* "
                      "without ops_port)")
    log_level: LogLevel = Field("info", description="level of the router's own log lines")
    access_log: bool = Field(False, description="one log line per request (aiohttp's access log); turns the lean "
                             "listener off")

    # replicas
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list, description="vLLM base URLs, e.g. http://10.0.0.5:8000")
    discover: str | None = Field(None, description="host:port of a headless service; A records resolved periodically")
    discover_interval_s: float = Field(10.0, gt=0, description="seconds between DNS resolutions of discover")
    health_interval_s: float = Field(2.0, gt=0, description="seconds between health probes of each replica")
    health_timeout_s: float = Field(1.0, gt=0, description="a health probe unanswered this long fails")
    health_failure_threshold: int = Field(3, ge=1, description="failed probes in a row that take a replica out")
    health_success_threshold: int = Field(1, ge=1, description="good probes in a row that bring it back")
    breaker_failure_threshold: int = Field(5, ge=1, description="failed requests in a row that eject a replica "
                                           "(reason consecutive_failures)")
    breaker_cooldown_s: float = Field(10.0, gt=0, description="an ejected replica gets one trial request after this "
                                      "long; a success brings it back")
    models_refresh_interval_s: float = Field(30.0, gt=0, description="seconds between reads of each replica's "
                                             "/v1/models (router/models.py)")
    models_timeout_s: float = Field(5.0, gt=0, description="a read of a replica's /v1/models not done in this long "
                                    "fails (it keeps its last list): a list of many LoRA adapters takes longer than a "
                                    "health probe")
    models_list_bytes_per_s: int = Field(64 * 2**20, ge=0, description="the most bytes a second the router's own "
                                         "GET /v1/models answers send (the union of the replicas' lists: 16 MB at "
                                         "100,000 LoRA adapters, 0.6 MB gzipped); beyond it a 429 with Retry-After "
                                         "(llm_router_model_list_refusals_total); with --workers, each worker's. "
                                         "0: no limit")
    metrics_max_models: int = Field(32, ge=0, description="models with a `model` label value of their own in the "
                                    "router's metrics and decision log: the first this many distinct served models "
                                    "requested; any other is 'other' (clients choose the model, and vLLM lists every "
                                    "LoRA adapter). With --workers W, each worker's first: at most W x this")

    # upstream requests
    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to a replica longer than this fails the attempt")
    first_byte_timeout_s: float = Field(120.0, gt=0, description="until response headers and the first body chunk")
    idle_timeout_s: float | None = Field(300.0, gt=0, description="between body chunks, and for a response's head "
                                         "from the request (interim heads do not extend it); no total timeout on a body")
    max_retries: int = Field(2, ge=0, description="a failed attempt is retried on another healthy replica at most this "
                             "many times")
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="largest request body accepted")
    max_connections: int = Field(0, ge=0, description="upstream connection pool size; 0 = unlimited")
    replica_ca_file: Path | None = Field(None, description="PEM file of CA certificates to trust for https replicas, "
                                         "besides the system's (a private CA or a self-signed replica); "
                                         "verification stays on")
    lean_client: bool = Field(True, description="send generation requests to plain-http replicas with the lean "
                              "HTTP/1.1 client (router/http/client.py) instead of aiohttp's client; https replicas "
                              "always use aiohttp's")
    passthrough_paths: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_PASSTHROUGH_PATHS),
        description="paths besides /v1/completions and /v1/chat/completions forwarded to a replica (GET/POST); "
        "'/prefix/*' matches any deeper path. Everything else is 404: vLLM's own endpoints stay unreachable",
    )
    max_tokens_limit: int = Field(1 << 20, ge=1, description="largest max_tokens (or max_completion_tokens) x n a request may "
                                  "ask for: the tokens one request may make over its n choices; more is a 400")

    # outlier detection and ejection (request outcomes blamed on a replica only)
    max_ejected_ratio: float = Field(
        0.5, ge=0, le=1, description="panic threshold: the breaker and outlier detection never eject a replica when "
        "that would put more than this share of the fleet out of rotation (ejected, failing its health probe or "
        "draining); at least one always stays in rotation",
    )
    outlier_window: int = Field(20, ge=2, description="recent outcomes per replica and kind (stream / not) judged")
    outlier_min_requests: int = Field(5, ge=1, description="outcomes in a window before its failure ratio counts")
    outlier_failure_ratio: float = Field(0.5, gt=0, le=1, description="eject when this share of a window failed")
    outlier_ttfb_ratio: float = Field(10.0, gt=1, description="eject when the median time to first byte is this many "
                                      "times its peers' median (streams sent to an idle replica only: a queue is "
                                      "load, not a fault) ...")
    outlier_ttfb_min_s: float = Field(2.0, gt=0, description="... and above this")
    stall_timeout_s: float = Field(
        30.0, gt=0, description="eject a replica with requests in flight that sent no byte, and whose scraped "
        "vllm:generation_tokens_total did not grow, for this long while a peer did not stall; its unanswered "
        "requests are retried elsewhere, its streams end with an error event. Also: a stream silent this long ends",
    )

    # client side of the listener
    header_timeout_s: float = Field(10.0, gt=0, description="a request's line and headers must arrive within this")
    body_timeout_s: float = Field(30.0, gt=0, description="a request's body must arrive within this")
    keepalive_timeout_s: float = Field(75.0, gt=0, description="idle keep-alive connections are closed after this")
    max_client_connections: int | None = Field(
        None, ge=1, description="client connections open at once; at the cap the longest-idle one is closed to make "
        "room, else a new one is refused with a 503 (/health and /ready still answered). Unset: derived from the "
        "open-file limit (raised to the hard limit at start): half of what a reserve leaves, at most 65536; a value "
        "above what the limit allows is lowered to it with a warning",
    )
    max_connections_per_client: int | None = Field(
        None, ge=1, description="client connections open at once from one client address (unset: half of "
        "max_client_connections); behind a proxy or load balancer all clients arrive from its address: raise it",
    )
    max_header_bytes: int = Field(16384, ge=1024, le=1 << 20, description="a request's line and headers; larger get a "
                                  "431 (16 KiB: uvicorn's h11 and Node's default)")
    lean_listener: bool = Field(True, description="serve plain POST /v1/completions and /v1/chat/completions on "
                                "the lean HTTP/1.1 listener (router/http/server.py) instead of aiohttp's server side; "
                                "anything else on a connection hands it to aiohttp. Off with access_log")
    replica_header: bool = Field(False, description="add x-routewise-replica (the serving replica's host:port) to "
                                 "responses; off by default: it reveals the fleet's addresses")
    ops_host: str | None = Field(None, description="listen address of the ops listener (default: host)")
    ops_port: int | None = Field(
        None, ge=0, le=65535, description="serve /metrics and /admin/* on this port only (not on the public port)",
    )

    # metrics scraping
    scrape_interval_s: float = Field(1.0, gt=0, description="seconds between scrapes of each replica's /metrics")
    scrape_timeout_s: float = Field(0.8, gt=0, description="default: min(0.8, scrape_interval_s)")

    # routing
    policy: str = Field(DEFAULT_POLICY, description="a baseline, `gated` (the recommended shipped model, any-fleet, handing "
                        "uniform pools where the cache decides to llm-d's algorithm), `gated:MODEL` (the gate around another model, "
                        "e.g. gated:cache-fleet for pools of one GPU kind), `learned` (the model alone), a shipped "
                        "model's name (any-fleet, cache-fleet, late-fleet, suite-fleet) or an .onnx path")
    allow_fallback_start: bool = Field(
        False, description="start even when a policy (any arm, the shadow) does not load, serving its decisions with "
        "least-outstanding (the fallback); off: `router serve` exits with one line naming the cause",
    )
    seed: int | None = Field(None, description="seed of policies that draw at random (random, power-of-two, "
                             "exploration); unset: from the OS")
    decision_budget_s: float | None = Field(0.0005, gt=0, description="time budget of one decision (the deciding "
                                            "thread's CPU time): a policy over it on most of its recent decisions is "
                                            "skipped for a cool-down (docs/decision-budget.md); unset: no budget")
    max_stats_age_s: float | None = Field(None, gt=0, description="unset: 30 for learned policies, off for baselines (per arm); set: every arm")
    overload_margin: int | None = Field(None, ge=0, description="unset: 32 for learned policies, off for baselines (per arm); set: every arm")
    overload_ratio: float | None = Field(
        None, ge=0, description="the overload guard's reference is max(least, ratio x the other replicas' mean outstanding); "
        "default 8 for learned policies, 0 (the least-loaded replica only) otherwise"
    )
    min_confidence: float | None = Field(None, ge=0, le=1, description="a learned pick whose softmax probability is "
                                         "below this falls back (reason low_confidence); unset: off")
    chars_per_token: float = Field(4.0, gt=0, description="characters per token when estimating a prompt's tokens")
    prefix_capacity_blocks: int = Field(4096, ge=1, description="prompt-prefix blocks the router's approximate "
                                        "prefix index remembers")
    # the replicas' KV-cache events (router/kv/events.py, docs/kv-events.md)
    kv_events: Literal["on", "off"] = Field("on", description="subscribe to each replica's KV-cache events (found "
                                            "through its /kv_event_sources) and take prefix matches from what it "
                                            "reports cached; off: the router's own guess only")
    kv_events_bind: str | None = Field(None, description="a ZMQ address (tcp://0.0.0.0:5557) the router binds for "
                                       "replicas whose --kv-events-config endpoint is concrete (they connect to it); "
                                       "replicas are told apart by topic")
    kv_events_max_blocks: int = Field(1 << 20, ge=1, description="blocks the KV view keeps per replica; beyond it "
                                      "the oldest are forgotten (llm_router_kv_view_dropped_blocks_total)")
    kv_events_stale_hold_s: float = Field(30.0, ge=0, description="after a sequence gap no replay filled, bad input "
                                          "or a lost replica, its view is stale (the guess is used) this long")
    kv_events_inflight_s: float = Field(DEFAULT_INFLIGHT_S, ge=0, description="a prompt's blocks count as cached on "
                                        "the replica the router sent them to for this long, before its KV events "
                                        "can report them (a burst on one document stays together); 0: events only")
    kv_events_max_batches_per_s: float = Field(10000.0, ge=0, description="KV event batches read per second per "
                                               "subscription at most (a flooding publisher waits); 0: no limit")
    kv_events_max_batch_events: int = Field(10000, ge=1, description="a KV event batch with more events is ignored "
                                            "(reason huge_batch)")
    kv_events_max_batch_bytes: int = Field(8 << 20, ge=1024, description="a KV event message larger than this is "
                                           "ignored (reason huge_batch)")
    kv_events_refresh_s: float = Field(5.0, gt=0, description="seconds between looks for replicas' KV event "
                                       "publishers (new replicas, lost health)")
    tokenizer: str | None = Field(None, description="a folder with the model's tokenizer.json (and chat template): "
                                  "prompts are tokenized here for the KV view; unset: a replica's /tokenize, once per "
                                  "prompt prefix, in the background")

    # late binding (router/hold_queue.py): hold requests in a router-side queue while no replica has room
    late_binding: bool | None = Field(
        None, description="hold a request in a bounded router-side FIFO while every healthy replica is at its "
        "concurrency limit, and dispatch it when one frees (router.policy.late_binding); off: route at once. "
        "Unset: on for a learned policy (every shipped model measured better behind it), off for a baseline",
    )
    late_binding_timeout_s: float = Field(
        LateBindingConfig.timeout_s, ge=0, description="a held request waits at most this long, then goes to the "
        "policy's pick over every healthy replica, room or not (counted as reason=timeout)",
    )
    late_binding_queue_per_replica: int = Field(
        LateBindingConfig.queue_per_replica, ge=0, description="queue capacity = this x replicas; an arrival at a "
        "full queue is dispatched at once (reason=full)",
    )
    late_binding_max_num_seqs: int | None = Field(
        None, ge=1, description="a replica has room below this many requests in flight (your servers' "
        "--max-num-seqs), lowered per replica to what its scraped KV cache holds. Unset: inferred per replica from "
        "its /metrics (the running count it plateaus at while requests wait; llm_router_replica_batch_limit); until "
        "then only the KV-derived limit applies",
    )
    late_binding_replica_max_num_seqs: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict, description="per replica (host:port or base URL) overrides of late_binding_max_num_seqs, "
        "for fleets whose servers run different --max-num-seqs; e.g. {\"10.0.0.5:8000\": 8}",
    )
    late_binding_max_batched_tokens: int = Field(
        8192, ge=1, description="... and while the prompt tokens awaiting their first token there are below this "
        "(vLLM's max_num_batched_tokens)",
    )
    late_binding_tokens_per_request: int = Field(
        LateBindingConfig.tokens_per_request, ge=1, description="KV tokens one request is assumed to hold: the "
        "KV-derived limit is scraped capacity // this",
    )
    late_binding_room_in_time: bool = Field(
        LateBindingConfig.room_in_time, description="multiply each replica's awaiting-prefill limit by how many times "
        "faster than the fleet's slowest replica it runs, by the router's TPOT floors (floored, at most 2, so 1 on a "
        "uniform fleet): room measured in time, not tokens; off: the same token limit for every replica",
    )
    slo_default_ttft_s: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict, description="TTFT target by model for a request without an x-slo-ttft-ms header "
        "('*': every model), e.g. {\"llama-8b\": 0.5} or llama-8b=0.5,*=2: late binding dispatches the earliest "
        "deadline first; attainment in llm_router_slo_attainment_total",
    )
    slo_default_tpot_s: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict, description="TPOT target by model for a request without an x-slo-tpot-ms header "
        "('*': every model), as slo_default_ttft_s; counted in llm_router_slo_attainment_total",
    )

    # serving extensions (shadow, A/B, decision log, hot reload), validated here and passed down
    shadow_policy: str | None = Field(None, description="a second policy that decides on every request without acting")
    ab_treatment: str | None = Field(None, description="treatment policy of an A/B split (control = policy)")
    ab_share: float = Field(0.0, ge=0.0, le=1.0, description="share of request keys routed by the treatment")
    ab_window_requests: int = Field(1000, ge=1, description="rollback guard: outcomes kept per arm")
    ab_window_s: float = Field(300.0, gt=0, description="rollback guard: oldest outcome kept, seconds")
    ab_min_samples: int = Field(500, ge=1, description="rollback guard: outcomes per arm before a verdict")
    ab_max_p99_ratio: float = Field(1.2, gt=0, description="roll back when treatment p99 TTFT / control p99 exceeds this")
    ab_max_error_rate_delta: float = Field(0.01, ge=0, le=1, description="... or its error rate exceeds control's by this")
    ab_auto_promote: bool = Field(
        False, description="a model reloaded into the treatment arm is a candidate: promoted to control when the guard's "
        "window finds it no worse, rolled back otherwise (router/serving/promotion.py; `trainer follow`)"
    )
    ab_explore_share: float = Field(
        0.0, ge=0.0, le=0.2, description="with ab_auto_promote: share of treatment decisions sent to a random healthy "
        "replica, so the decision log shows outcomes the policy would not pick (counted)"
    )
    decision_log_dir: Path | None = None
    decision_log_max_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="start a new file past this size")
    decision_log_keep: int = Field(10, ge=1, description="decision log files kept (oldest deleted)")
    decision_log_queue: int = Field(10_000, ge=1, description="records waiting to be written; more are dropped and counted")
    policy_watch_interval_s: float | None = Field(5.0, gt=0, description="poll learned policy files for changes; None = off")

    # client authentication (vLLM's --api-key)
    api_key: SecretStr | None = Field(None, description="clients must send `Authorization: Bearer <key>` on every "
                                      "/v1/* path, as vLLM's --api-key asks (401 otherwise); unset = no client "
                                      "authentication. Visible in ps: prefer ROUTEWISE_API_KEY or api_key_file")
    api_key_file: Path | None = Field(None, description="read the client API keys from this file, one per line "
                                      "(several keys: any of them is accepted; rotate by adding the new one first)")

    # admin and lifecycle
    admin_token: SecretStr | None = None
    admin_token_file: Path | None = Field(None, description="read admin_token from this file (not visible in ps)")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight may take "
                                   "before the router exits")
    workers: int = Field(1, ge=1, le=64, description="worker processes sharing the port and the host's in-flight "
                         "load (router.scale.workers); 1 = a single process")

    # shared fleet view across router processes on several hosts (router/scale/fleet_view.py)
    shared_state: str | None = Field(None, description="redis://HOST:PORT/DB (or rediss://, unix://) of a Redis or "
                                     "Valkey that the fleet's routers share their in-flight counts through; unset = "
                                     "each router decides on its own counts")
    shared_state_interval_s: float = Field(0.01, gt=0, le=1.0, description="seconds between syncs with shared_state "
                                           "(publish this router's changed counts, read the others' sums)")
    shared_state_ttl_s: float = Field(2.0, gt=0, description="a router that stops syncing (dead, cut off) stops "
                                      "counting in the others' views after this long")
    shared_state_timeout_s: float = Field(0.2, gt=0, description="a sync unanswered this long fails: the router "
                                          "decides on its own counts until one succeeds")

    @field_validator("passthrough_paths", mode="before")
    @classmethod
    def _split_paths(cls, v: Any) -> Any:
        if isinstance(v, str):  # ROUTEWISE_PASSTHROUGH_PATHS: a JSON list or comma-separated paths
            return json.loads(v) if v.lstrip().startswith("[") else [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("passthrough_paths")
    @classmethod
    def _check_paths(cls, v: list[str]) -> list[str]:
        for p in v:
            base = p.removesuffix("/*")
            if not base.startswith("/") or normalise_path(base) != base:
                raise ValueError(f"passthrough_paths: {p!r} is not a plain absolute path (no '.', '..', '//', '%', "
                                 "query or trailing slash)")
        return v

    @field_validator("admin_token", "api_key")
    @classmethod
    def _check_token(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError(f"{info.field_name} is empty: give a real one or none (off)")
        return v

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, v: Any) -> Any:
        if isinstance(v, str):  # ROUTEWISE_REPLICAS: a JSON list or comma-separated URLs
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [p.strip() for p in v.split(",") if p.strip()]
        return v

    @field_validator("replicas")
    @classmethod
    def _check_replicas(cls, v: list[str]) -> list[str]:
        out: list[str] = []
        for raw in v:
            u = URL(raw)
            if u.scheme not in ("http", "https") or not u.host or u.explicit_port is None and u.port is None:
                raise ValueError(f"replicas: {raw!r} is not an http(s)://host:port URL")
            if u.path not in ("", "/") or u.query_string:
                raise ValueError(f"replicas: {raw!r} must be a base URL without a path or query")
            out.append(str(u.origin()))
        if len({replica_id(x) for x in out}) != len(out):
            raise ValueError(f"replicas: duplicate host:port in {v!r}")
        return out

    @field_validator("late_binding_replica_max_num_seqs", mode="before")
    @classmethod
    def _pairs(cls, v: Any) -> Any:
        if isinstance(v, str):  # ROUTEWISE_LATE_BINDING_REPLICA_MAX_NUM_SEQS: JSON object or HOST:PORT=N,...
            if v.lstrip().startswith("{"):
                return json.loads(v)
            v = [p for p in v.split(",") if p.strip()]
        if isinstance(v, (list, tuple)):  # --replica-max-num-seqs HOST:PORT=N (repeatable)
            out = {}
            for item in v:
                key, sep, n = str(item).strip().rpartition("=")
                if not sep or not key:
                    raise ValueError(f"late_binding_replica_max_num_seqs: {item!r} is not HOST:PORT=N")
                out[key] = n
            return out
        return v

    @field_validator("slo_default_ttft_s", "slo_default_tpot_s", mode="before")
    @classmethod
    def _model_targets(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str):  # JSON object or MODEL=S,...
            if v.lstrip().startswith("{"):
                return json.loads(v)
            v = [p for p in v.split(",") if p.strip()]
        if isinstance(v, (list, tuple)):
            out = {}
            for item in v:
                key, sep, s = str(item).strip().rpartition("=")
                if not sep or not key:
                    raise ValueError(f"{info.field_name}: {item!r} is not MODEL=SECONDS")
                out[key] = s
            return out
        return v

    @field_validator("slo_default_ttft_s", "slo_default_tpot_s")
    @classmethod
    def _check_model_targets(cls, v: dict[str, float], info: ValidationInfo) -> dict[str, float]:
        for key, s in v.items():
            if not math.isfinite(s) or s <= 0:
                raise ValueError(f"{info.field_name}: {key!r}={s}: need a positive number of seconds")
        return v

    @field_validator("late_binding_replica_max_num_seqs")
    @classmethod
    def _check_replica_caps(cls, v: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, n in v.items():
            u = URL(key if "://" in key else f"http://{key}")
            if not u.host or u.explicit_port is None and "://" not in key:
                raise ValueError(f"late_binding_replica_max_num_seqs: {key!r} is not a replica's host:port or base URL")
            if n < 1:
                raise ValueError(f"late_binding_replica_max_num_seqs: {key!r}={n}: need at least 1")
            out[replica_id(u)] = n
        return out

    @field_validator("discover")
    @classmethod
    def _check_discover(cls, v: str | None) -> str | None:
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"discover={v!r}: expected host:port")
        return v

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, v: str) -> str:
        return check_policy_name(v, "policy")

    @field_validator("shadow_policy", "ab_treatment")
    @classmethod
    def _check_optional_policy(cls, v: str | None, info) -> str | None:
        return None if v is None else check_policy_name(v, info.field_name)

    @model_validator(mode="after")
    def _finish(self) -> "RouterSettings":
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise ValueError("admin_token_file: give admin_token or admin_token_file, not both")
            try:
                token = self.admin_token_file.read_text().strip()
            except OSError as exc:
                raise ValueError(f"admin_token_file={str(self.admin_token_file)!r}: {exc.strerror}") from None
            if not token:
                raise ValueError(f"admin_token_file={str(self.admin_token_file)!r}: the file is empty")
            self.admin_token = SecretStr(token)
        if self.api_key_file is not None:
            if self.api_key is not None:
                raise ValueError("api_key_file: give api_key or api_key_file, not both")
            try:
                keys = [line.strip() for line in self.api_key_file.read_text().splitlines() if line.strip()]
            except OSError as exc:
                raise ValueError(f"api_key_file={str(self.api_key_file)!r}: {exc.strerror}") from None
            if not keys:
                raise ValueError(f"api_key_file={str(self.api_key_file)!r}: the file has no key")
            self.api_key = SecretStr("\n".join(keys))
        if self.replica_ca_file is not None:
            replica_tls_context(self.replica_ca_file)  # a missing or unreadable file fails here, in one line
        if self.ops_port is not None and self.ops_port == self.port and self.port != 0:
            raise ValueError(f"ops_port={self.ops_port}: must differ from port")
        if self.ab_share > 0 and self.ab_treatment is None:
            raise ValueError(f"ab_share={self.ab_share}: needs ab_treatment")
        if self.ab_min_samples > self.ab_window_requests:
            raise ValueError(f"ab_min_samples={self.ab_min_samples}: must not exceed ab_window_requests={self.ab_window_requests}")
        if self.decision_log_dir is not None and self.decision_log_dir.exists() and not self.decision_log_dir.is_dir():
            raise ValueError(f"decision_log_dir={str(self.decision_log_dir)!r}: exists and is not a directory")
        if "scrape_timeout_s" not in self.model_fields_set:
            self.scrape_timeout_s = min(self.scrape_timeout_s, self.scrape_interval_s)
        if self.late_binding is None:
            self.late_binding = is_learned(self.policy)
        if self.scrape_timeout_s > self.scrape_interval_s:
            raise ValueError(f"scrape_timeout_s={self.scrape_timeout_s}: must not exceed scrape_interval_s={self.scrape_interval_s}")
        if self.shared_state is not None:
            scheme = self.shared_state.partition("://")[0] if "://" in self.shared_state else ""
            if scheme not in ("redis", "rediss", "unix"):
                raise ValueError(f"shared_state={redact_url(self.shared_state)!r}: expected redis://HOST:PORT/DB, "
                                 "rediss://... or unix://PATH")
            if self.shared_state_ttl_s <= self.shared_state_interval_s + self.shared_state_timeout_s:
                raise ValueError(f"shared_state_ttl_s={self.shared_state_ttl_s}: must exceed shared_state_interval_s "
                                 f"+ shared_state_timeout_s ({self.shared_state_interval_s + self.shared_state_timeout_s:g}), "
                                 "or live routers would expire between syncs")
        return self

    # each component's own config (the component reads nothing else and never sees RouterSettings)
    def replica_config(self) -> ReplicaConfig:
        """The replica set's: membership, health probes, model lists, batch caps, the breaker and outlier ejection."""
        return _fill(ReplicaConfig, self, replicas=tuple(self.replicas), ejection=_fill(EjectionConfig, self),
                     late_binding_replica_max_num_seqs=MappingProxyType(dict(self.late_binding_replica_max_num_seqs)))

    def scrape_config(self) -> ScrapeConfig:
        return _fill(ScrapeConfig, self)

    def passthrough_config(self) -> PassthroughConfig:
        return _fill(PassthroughConfig, self, passthrough_paths=tuple(self.passthrough_paths))

    def fleet_view_config(self) -> FleetViewConfig | None:
        """The shared fleet view's, None without shared_state."""
        return None if self.shared_state is None else _fill(FleetViewConfig, self)

    def workers_config(self) -> WorkersConfig:
        return _fill(WorkersConfig, self)

    def for_worker(self, slot: int) -> RouterSettings:
        """Worker `slot`'s settings under `--workers N`: its own decision log directory, DIR/worker-<slot> (files of
        one writer each, so rotation and `keep` stay per file set; read each worker's directory)."""
        if self.decision_log_dir is None:
            return self
        return self.model_copy(update={"decision_log_dir": self.decision_log_dir / f"worker-{slot}"})


def replica_tls_context(ca_file: Path | None) -> ssl.SSLContext:
    """The verifying context for https replicas: the system's trust store, plus `ca_file`'s certificates."""
    ctx = ssl.create_default_context()
    if ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=str(ca_file))
        except ssl.SSLError as exc:  # an OSError too: first
            raise ValueError(f"replica_ca_file={str(ca_file)!r}: no PEM certificate read ({exc.reason})") from None
        except OSError as exc:
            raise ValueError(f"replica_ca_file={str(ca_file)!r}: {exc.strerror or exc}") from None
    return ctx


def load_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON mapping of RouterSettings fields. ValueError with one line naming the cause otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"config file {p}: is a directory")
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ValueError(f"config file {p}: not found") from None
    except OSError as exc:
        raise ValueError(f"config file {p}: cannot read it: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"config file {p}: not text ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                         + " ".join(str(exc).split())) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(RouterSettings.model_fields))
    if unknown:
        raise ValueError(f"config file {p}: unknown setting(s) {', '.join(unknown)}")
    return data


def fleet_problem(settings: RouterSettings) -> str | None:
    """Why these settings cannot serve (no replica and no discovery), or None. Not a validation rule: the settings
    without a fleet are still shown by `--print-config`."""
    if not settings.replicas and settings.discover is None:
        return "replicas: no replicas; give --replica URL (repeatable) or --discover host:port"
    return None


def build_settings(config_file: str | Path | None = None, *, explicit_none: Iterable[str] = (),
                   **overrides: Any) -> RouterSettings:
    """Flags (`overrides`, None = not given; `explicit_none`: fields a flag set to none) over environment over config
    file over defaults."""
    merged: dict[str, Any] = load_config_file(config_file) if config_file else {}
    merged.update(EnvSettingsSource(RouterSettings)())
    merged.update({k: v for k, v in overrides.items() if v is not None})
    merged.update(dict.fromkeys(explicit_none))
    return RouterSettings(**merged)


def redacted(settings: RouterSettings) -> dict[str, Any]:
    """The effective settings as JSON values, secrets (the admin token, a URL's password) shown as "<redacted>"."""
    data = settings.model_dump(mode="json")
    if data.get("shared_state"):
        data["shared_state"] = redact_url(data["shared_state"])
    for name, field in RouterSettings.model_fields.items():
        if field.annotation is not None and "SecretStr" in str(field.annotation) and data.get(name) is not None:
            data[name] = "<redacted>"
    return data
