"""Proxy configuration: every ``splice serve`` flag is also a ``SPLICE_*`` environment variable."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_max_inflight() -> int:
    """Turns in flight before requests wait: 128 per CPU core, between 256 and 4096."""
    return max(256, min(4096, 128 * (os.cpu_count() or 2)))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPLICE_", extra="ignore")

    engine: Literal["sglang", "vllm", "reference"] = "reference"
    engine_url: list[str] = Field(default_factory=list)  # empty: start the bundled reference engine
    routing: Literal["hash", "least-loaded"] = "hash"  # sessions -> replicas: consistent hashing, or least in-flight then sticky
    tokenizer: str | None = None  # path or hub id; default: the engine's model dir / bundled Qwen3
    renderer: str | None = None  # a `renderers` family (e.g. qwen3) or "generic"
    model_name: str = "splice-model"  # what /v1/models reports; also picks the renderer if known
    engine_model: str | None = None  # the model id vLLM requests name; default: what its /v1/models lists
    store: str = "splice_data/splice.sqlite"
    host: str = "127.0.0.1"
    port: int = 8000
    admin_token: str | None = None  # the trainer's: pulls, /admin, session listing / reading / rewards
    api_key: str | None = None  # the agents': Responses, Chat, Messages
    reward_token: str | None = None  # a grader's: rewards and session listing / reading only
    ui: bool = True  # the session viewer at /ui (docs/viewer.md); --no-ui turns it off
    thinking_retention: Literal["all", "tool_cycle", "template"] = "all"
    # A replayed history that differs from the recorded turns only in system / developer text or
    # earlier tool-call arguments: "fork" renders it in full (a new sample), "keep" continues the
    # recorded tokens and records the edit. A request's X-Splice-History-Edits header overrides it.
    history_edits: Literal["fork", "keep"] = "fork"
    # Harness side calls (titles, topics, quota probes: role "auxiliary", proxy.session.roles) are
    # recorded but handed to the trainer only with this on, as samples of their own.
    train_auxiliary: bool = False
    sampling: Literal["trainable", "honor"] = "trainable"
    # Counting the drift a full re-render would have caused costs a full render per checked turn
    # (off the hot path, but CPU): "sampled" inherits a parent's drift and renders turns 1, 2, 4, 8, ...
    # of sessions that have not drifted yet.
    drift_check: Literal["all", "sampled", "off"] = "sampled"
    temperature: float = 1.0  # the server-wide sampling temperature (trainable mode)
    max_context: int | None = None  # prompt + output tokens; default (and upper bound): the engine's own
    max_output_tokens: int | None = None  # caps every turn's output; None: as much as fits in the context
    lease_timeout_s: float = 600.0
    # R2 (docs/design.md section 4): how long a pause (or a pull) waits for owed proximal values
    # before going ahead without them (they are counted missing), and prefill-only calls in
    # flight per engine replica.
    recompute_deadline_s: float = Field(default=60.0, ge=0)
    recompute_concurrency: int = Field(default=2, ge=1)
    # A pull never hands out a sample holding loss tokens older than current version - K (None: off).
    max_staleness: int | None = Field(default=None, ge=0)
    transfer_deadline_s: float = Field(default=600.0, gt=0)  # a weight transfer with no join / bucket / commit this long is abandoned
    max_pause_s: float = Field(default=600.0, gt=0)  # a pause nobody resumes is lifted after this (held turns go on)
    max_request_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)  # request line + headers; larger is a 431
    header_timeout_s: float = Field(default=10.0, gt=0)  # headers not complete this long after a connection / request began: 408
    body_timeout_s: float = Field(default=60.0, gt=0)  # the whole body not read this long after the headers: 408
    # An agent's idle connection is kept this long: past the pool idle time of common clients
    # (httpx 5 s, Node 4 s, reqwest and Go 90 s), so the client closes first and never writes a
    # turn on a connection the server is closing.
    keepalive_s: float = Field(default=120.0, gt=0)
    max_inflight: int = Field(default_factory=lambda: default_max_inflight())  # concurrent turns, then a wait, then 429
    admission_wait_s: float = 2.0  # how long a request beyond max_inflight waits for a slot before 429
    engine_timeout_s: float = 600.0  # total deadline of one engine call (not per read)
    # Images (vision models: a tokenizer folder with a Qwen2-VL preprocessor_config.json).
    allow_image_urls: bool = False  # fetch http(s) image URLs; off: only inline base64 images (a URL is a 400)
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1)  # one encoded image (inline or fetched)
    max_image_pixels: int = Field(default=50_000_000, ge=1)  # one decoded image: width x height (decompression bombs)
    max_images_per_request: int = Field(default=64, ge=0)  # image parts in one request, history included
    image_fetch_timeout_s: float = Field(default=10.0, gt=0)  # total time to fetch one image URL
    # Fetched only from public addresses (after DNS resolution, on every redirect), or from these networks (CIDR).
    image_url_allow_net: list[str] = Field(default_factory=list)
    max_request_image_pixels: int = Field(default=256_000_000, ge=1)  # one request's images together (decode CPU)
    image_decode_concurrency: int = Field(default=2, ge=1)  # decodes at once, proxy-wide (each holds its pixels ~3x)
    image_cache_entries: int = Field(default=1024, ge=1)  # decoded images remembered (agents resend history images)
    image_cache_bytes: int = Field(default=512 * 1024 * 1024, ge=0)  # encoded bytes the decode cache may hold
    quiet: bool = False  # no per-turn / progress lines on the console
    reference_model: str | None = None  # model dir for the bundled engine (created if missing)
    reference_script: str | None = None  # script file for the bundled engine
    reference_script_delay_ms: int = 0

    @field_validator("image_url_allow_net")
    @classmethod
    def _networks(cls, values: list[str]) -> list[str]:
        import ipaddress

        for v in values:
            ipaddress.ip_network(v.strip(), strict=False)  # ValueError: pydantic names the field
        return values
