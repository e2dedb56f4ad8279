"""Records that flow between workloads, the cluster engine and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload, with the truth the router does not see.

    `block_ids` are content ids of the prompt's leading prefix blocks of `block_tokens` tokens
    each (Mooncake `hash_ids`, or generated); identical leading ids mean shareable KV cache.
    """

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...] = field(default=())
    block_tokens: int = 512
    max_tokens: int | None = None  # what the client sent (None = not sent)
    tenant: str = ""
    model: str | None = None  # the request's `model` (None: any replica may serve it)
    slo_class: str = ""  # its latency-target class (a scenario's `classes`), "" for none
    ttft_target_s: float | None = None  # its TTFT target (x-slo-ttft-ms live): late binding's deadline


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one request in a simulated run."""

    request_id: int
    replica_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    queue_delay_s: float = float("nan")  # arrival to first scheduling
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    tenant: str = ""
    error: str = ""  # "" when served; else why the replica refused it (e.g. "prompt_too_long")

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for single-token outputs)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)
