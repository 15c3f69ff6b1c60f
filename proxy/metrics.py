"""Prometheus metrics, one registry per app so tests and several apps in a process stay apart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as _Counter
from prometheus_client import Gauge
from prometheus_client import Histogram as _Histogram
from prometheus_client.core import CounterMetricFamily


class _Labelled:
    """``labels(...)`` remembered per label values: prometheus-client checks, converts and locks
    on every call, and a turn makes about ten. Children are never removed here, so the memo
    stays as small as the metric's own set of children."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._memo: dict[tuple, object] = {}

    def labels(self, *values: str):
        child = self._memo.get(values)
        if child is None:
            child = self._memo[values] = super().labels(*values)
        return child


class Counter(_Labelled, _Counter):
    pass


class Histogram(_Labelled, _Histogram):
    pass


class _HistoryReuse:
    """``splice_history_reuse_total{kind}``, read from the app's ``HistoryMemo`` when scraped:
    requests that reused their conversation's last request, its conversion (``conversion``) or
    its bytes (``bytes``: parsed only from what they add)."""

    def __init__(self, memo) -> None:
        self.memo = memo

    def collect(self):
        family = CounterMetricFamily(
            "splice_history_reuse", "Requests that reused their conversation's last request, by what they reused", labels=["kind"]
        )
        family.add_metric(["conversion"], self.memo.reused)
        family.add_metric(["bytes"], self.memo.resent_parsed)
        yield family


_LAT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("splice_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.errors = Counter("splice_errors", "Error responses by route and code", ["route", "code"], registry=r)
        self.request_seconds = Histogram("splice_request_seconds", "Wall time per request", ["route"], buckets=_LAT, registry=r)
        self.proxy_seconds = Histogram(
            "splice_proxy_seconds", "Proxy's own time per turn (wall time minus engine time)", buckets=_LAT, registry=r
        )
        self.engine_seconds = Histogram("splice_engine_seconds", "Engine time per turn", buckets=_LAT, registry=r)
        self.stage_seconds = Histogram(
            "splice_stage_seconds", "Proxy time per stage of a turn", ["stage"], buckets=_LAT, registry=r
        )
        self.tokens_in = Counter("splice_prompt_tokens", "Prompt tokens sent to engines", registry=r)
        self.tokens_out = Counter("splice_output_tokens", "Tokens generated", registry=r)
        self.turns = Counter("splice_turns", "Finished turns by api", ["api"], registry=r)
        self.roles = Counter("splice_turn_roles", "Finished turns by episode role (main, auxiliary, subagent, compacted)", ["role"], registry=r)
        self.spliced = Counter("splice_spliced_turns", "Turns whose prompt was spliced from verbatim ids", registry=r)
        self.render_reused = Counter(
            "splice_render_reused", "First turns whose prompt ids were reused from an equal first turn (a group's sessions)", registry=r
        )
        self.forks = Counter("splice_forks", "Turns rendered in full, by reason", ["reason"], registry=r)
        self.history_edits = Counter(
            "splice_history_edits_kept", "Turns that continued the recorded tokens despite a history edit (--history-edits keep), by edit",
            ["edit"], registry=r,
        )  # fmt: skip
        self.ambiguous_parents = Counter(
            "splice_ambiguous_parents", "Turns whose history matched several recorded turns (header-less sessions)", registry=r
        )
        self.drift = Counter(
            "splice_drift_avoided", "Spliced turns a full re-render would have tokenized differently", registry=r
        )
        self.aborts = Counter("splice_aborts", "Engine aborts (weight updates) during generation", registry=r)
        self.resumes = Counter("splice_resumes", "Generations resumed after an abort", registry=r)
        self.recomputed = Counter("splice_recomputed_tokens", "Proximal logprobs recomputed (R2)", registry=r)
        self.piggybacked = Counter(
            "splice_piggybacked_tokens", "Proximal logprobs filled by a session's next turn's own engine call (R2)", registry=r
        )
        self.recompute_prefills = Counter("splice_recompute_prefills", "Prefill-only engine calls made for R2 (one per session leaf)", registry=r)
        self.recompute_prefill_tokens = Counter("splice_recompute_prefill_tokens", "Tokens sent in R2 prefill-only calls", registry=r)
        self.missing = Counter(
            "splice_proximal_missing_tokens",
            "Tokens a pause went ahead without (no proximal value under the next version: proximal == behaviour)",
            registry=r,
        )
        self.stale_skipped = Counter(
            "splice_recompute_stale_skipped_tokens", "Owed tokens not recomputed because their sample is past --max-staleness", registry=r
        )
        self.dropped_stale = Counter(
            "splice_dropped_stale_samples", "Samples dropped at pull: loss tokens older than current - max_staleness", registry=r
        )
        self.pause_wait_seconds = Histogram(
            "splice_pause_recompute_seconds", "Time a pause waited for owed proximal values", buckets=_LAT, registry=r
        )
        self.sampling_overrides = Counter(
            "splice_sampling_overrides", "Requests whose sampling values were replaced by the trainable ones", registry=r
        )
        self.tools_not_offered = Counter(
            "splice_tools_not_offered", "Hosted tools a request sent that the model was not offered, by type", ["type"], registry=r
        )
        self.controls_not_enforced = Counter(
            "splice_controls_not_enforced", "Turns with a control Splice records but does not enforce, by control", ["control"], registry=r
        )
        self.malformed_calls = Counter("splice_malformed_tool_calls", "Tool calls returned as text", registry=r)
        self.banned_tokens_sampled = Counter(
            "splice_banned_tokens_sampled", "Turns whose output holds a token the engine was told never to sample "
            "(a vision placeholder); recorded untrainable", registry=r,
        )  # fmt: skip
        self.images_in = Counter("splice_prompt_images", "Images sent to engines (every image of every prompt)", registry=r)
        self.inflight = Gauge("splice_inflight_turns", "Turns in flight", registry=r)
        self.admission_active = Gauge("splice_admission_active", "Agent requests admitted and running", registry=r)
        self.admission_waiting = Gauge("splice_admission_waiting", "Agent requests waiting for a slot", registry=r)
        self.admission_rejected = Counter(
            "splice_admission_rejected", "Agent requests refused with 429 after the admission wait", registry=r
        )
        self.abandoned = Counter(
            "splice_abandoned_turns", "Turns whose client went away before the final body or event was sent", registry=r
        )
        self.commit_group = Histogram(
            "splice_commit_group_turns", "Turns committed per store transaction (group commit)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r,
        )  # fmt: skip
        self.store_bytes = Gauge("splice_store_bytes", "Size of the SQLite store on disk", registry=r)
        self.version = Gauge("splice_policy_version", "Current policy version", registry=r)

    def watch_history_memo(self, memo) -> None:
        """Export ``memo``'s reuse counts (``proxy/api/history_memo.py``) as ``splice_history_reuse_total``."""
        self.registry.register(_HistoryReuse(memo))
