"""Types shared by every engine client: what one generation returns, and how it fails.

All per-token lists are in token coordinates of the *output*: index ``i`` is output token ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """What Splice sends to an engine. Defaults are the trainable distribution (docs/design.md section 4)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off (SGLang and vLLM both accept -1)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # Token ids the engine must never sample (a vision model's placeholder and vision-control
    # ids). Sent as a logit bias only when non-empty, so text-only requests stay unchanged.
    banned_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineImage:
    """One image of a prompt, as an engine call carries it (docs/engines.md, "Images").

    ``offset`` / ``length``: the image's run of ``<|image_pad|>`` ids in the *expanded* prompt
    (index of the first pad, number of pads), which is the coordinate system of every id list
    and logprob position Splice handles. ``data`` is the image as received (png/jpeg/webp/gif),
    ``hash`` its content hash (sha256 over the decoded RGB pixels), ``grid_thw`` the image
    processor's patch grid (``length == t*h*w // merge_size**2``).
    """

    hash: str
    data: bytes
    mime: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]


@dataclass
class Generation:
    """One finished generation, possibly stitched from several abort-resume segments."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob per output token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    proximal_logprobs_t: list[float] = field(default_factory=list)
    proximal_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    matched_stop: int | str | None = None  # the stop token id / string the engine matched
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine_time_s: float = 0.0
    segments: int = 1  # engine calls that produced tokens (1 + number of resumes)
    aborts: int = 0
    replica: str = ""  # base URL of the replica that served it
    # Input logprobs of the *prompt* asked for with ``EnginePool.generate(prompt_logprobs_from=k)``
    # (R2 on the next turn): ``prompt_logprobs[j]`` is log pi(prompt[k + j] | prompt[:k + j])
    # under ``prompt_logprobs_version`` (None where the engine gave no value); empty when not asked.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    prompt_logprobs_version: int | None = None

    def check(self) -> None:
        """Raise if per-token arrays disagree in length (an engine or stitching bug)."""
        n = len(self.output_ids)
        lens = (len(self.logprobs), len(self.versions), len(self.proximal_logprobs_t), len(self.proximal_versions))
        if any(x != n for x in lens):
            raise AssertionError(f"per-token arrays out of step: {n} ids vs {lens}")


@dataclass(frozen=True)
class Segment:
    """One engine call's result, before stitching (what a wire client parses)."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    matched_stop: int | str | None = None
    # input logprobs for absolute prompt positions [input_logprobs_start, prompt_len); None where
    # the engine returned null (the first entry). Empty when none were requested.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_logprobs_start: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    # SGLang >= 0.5.23 ``meta_info.weight_versions``: (start, end, version) spans over this
    # segment's output tokens, for engines that can change weights mid-request.
    weight_version_spans: tuple[tuple[int, int, str], ...] = ()


@dataclass(frozen=True)
class EngineInfo:
    """What an engine says about itself, read from the engine at ``EnginePool.start()``.

    Every field is None / False when the engine did not say (older release, endpoint missing,
    replica down at start-up); nothing here is guessed from Splice's own configuration.

    - ``context_length``: the longest sequence (prompt + output) the engine accepts: vLLM's and
      SGLang's ``/v1/models`` ``max_model_len``, else SGLang's ``/server_info``
      ``context_length``.
    - ``model_path``: where the engine loaded the model from, on the engine's filesystem
      (vLLM's ``/v1/models`` ``root``, SGLang's ``/model_info`` ``model_path``): the default
      tokenizer when it is readable where the proxy runs.
    - ``served_model``: the model id to send in requests (``/v1/models`` ``id``).
    - ``weight_version``: the engine's weight version when it is an integer (SGLang
      ``/model_info``, vLLM ``/weight_info``); None for "default" or when not reported.
    - ``can_pause``: the pause / resume endpoints exist (SGLang ``/pause_generation`` +
      ``/continue_generation``; vLLM ``/pause`` + ``/resume``, dev mode only).
    - ``can_reload``: weights can be loaded from disk over HTTP (SGLang
      ``/update_weights_from_disk``; vLLM ``/collective_rpc`` + ``/update_weight_version`` +
      ``/weight_info``, dev mode only).
    - ``tied_lm_head``: the model ties its LM head to the embeddings (``tie_word_embeddings``),
      None when unknown. vLLM 0.32's in-place reload leaves a tied head stale (CPU build).
    - ``worker_extension``: vLLM runs Splice's worker extension (``engines/vllm_worker.py``),
      which re-ties a tied head after every weight load.
    - ``warnings``: what an operator should know (missing dev mode, tied head on vLLM, ...).
    """

    context_length: int | None = None
    model_path: str | None = None
    served_model: str | None = None
    weight_version: int | None = None
    can_pause: bool = False
    can_reload: bool = False
    tied_lm_head: bool | None = None
    worker_extension: bool = False
    warnings: tuple[str, ...] = ()


class EngineError(Exception):
    """Base for engine failures. ``retryable`` is true only when nothing was generated."""

    status_code = 502
    code = "engine_error"

    def __init__(self, message: str, *, replica: str = "", retryable: bool = True):
        super().__init__(message)
        self.replica = replica
        self.retryable = retryable


class EngineUnavailable(EngineError):
    """Connection refused / reset: the replica is down."""

    status_code = 503
    code = "engine_unavailable"


class EngineTimeout(EngineError):
    status_code = 504
    code = "engine_timeout"


class EngineBadResponse(EngineError):
    """5xx or malformed JSON from the engine."""

    status_code = 502
    code = "engine_bad_response"


class EngineUnsupported(EngineError):
    """The engine kind has no such operation (e.g. loading weights into vLLM over HTTP)."""

    status_code = 501
    code = "engine_unsupported"

    def __init__(self, message: str, *, replica: str = "", retryable: bool = False):
        super().__init__(message, replica=replica, retryable=retryable)


class EnginePaused(EngineError):
    """The engines are paused for a weight update; the call would block until they resume."""

    status_code = 503
    code = "engine_paused"


class EngineVersionChanged(EngineError):
    """The weights changed while a prefill was computed, so its values belong to no known version."""

    status_code = 409
    code = "engine_version_changed"


class EngineRejected(EngineError):
    """The engine refused the request (4xx): retrying the same request will not help."""

    status_code = 400
    code = "engine_rejected"

    def __init__(self, message: str, *, replica: str = "", retryable: bool = False):
        super().__init__(message, replica=replica, retryable=retryable)


class ContextLengthExceeded(EngineRejected):
    """The prompt leaves no room for one output token plus the recompute prefill of the turn
    (``EnginePool.max_new_tokens``); OpenAI's code for it is ``context_length_exceeded``."""

    status_code = 400
    code = "context_length_exceeded"
