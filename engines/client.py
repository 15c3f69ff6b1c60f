"""The interface every wire client (SGLang, vLLM) offers the pool, so routing and abort-resume
are written once and do not know which engine they drive."""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, Sequence

from engines.types import EngineBadResponse, EngineImage, EngineInfo, SamplingParams, Segment
from engines.weight_transfer import TensorBatch, WeightGroup  # noqa: F401 - the Protocol's types

# Called with the output ids (and their behaviour logprobs) new since the previous call.
TokensCallback = Callable[[list[int], list[float]], Awaitable[None]]


class EngineClient(Protocol):
    """One replica. Every method raises an ``engines.types.EngineError`` subclass on failure."""

    url: str

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str,
        input_logprobs_from: int | None = None,
        on_tokens: TokensCallback | None = None,
        routing_key: str | None = None,
        images: Sequence[EngineImage] = (),
    ) -> Segment:
        """One engine call. ``input_logprobs_from=k`` asks for log p(x_j | x_<j) for every
        absolute position j >= k (k >= 1), returned in ``Segment.input_logprobs`` indexed from
        ``Segment.input_logprobs_start``; None asks for none (keeps prefix caching intact).
        Streams when ``on_tokens`` is given. Cancelling the call aborts it on the engine.
        ``routing_key`` (the session id) keeps a session on one worker behind a router.
        ``images``: every image of ``input_ids`` (spans in its expanded coordinates, prompt
        order); all positions in and out stay expanded."""
        ...

    async def prefill(
        self,
        input_ids: list[int],
        start: int,
        *,
        routing_key: str | None = None,
        images: Sequence[EngineImage] = (),
    ) -> tuple[list[float], str | None]:
        """log p(x_k | x_<k) for k in [start, len(input_ids)) without sampling, plus the
        engine-reported weight version (None when the engine does not report one). Values at
        image pad positions are whatever the engine computes there; they are never owed."""
        ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, model_path: str, version: int) -> None: ...

    async def weight_version(self) -> str | None: ...

    async def set_weight_version(self, version: int) -> None:
        """Tell the engine its weights are ``version`` (they were moved by other means)."""
        ...

    async def health(self) -> bool: ...

    # weights over torch.distributed (engines.weight_transfer, docs/weight_transfer.md)

    async def weight_ranks(self) -> int:
        """How many ranks the engine joins a weight-update group with (its GPUs)."""
        ...

    async def init_weights_group(self, group: "WeightGroup") -> None:
        """Join ``group``; answers once every rank (the trainer's rank 0 too) arrived."""
        ...

    async def update_weights_from_distributed(self, batch: "TensorBatch") -> None:
        """Receive one bucket of broadcasts and load it; the final bucket stamps the version."""
        ...

    async def destroy_weights_group(self, group_name: str) -> None: ...

    async def info(self) -> EngineInfo:
        """What the engine says about itself (context length, model, version, control endpoints).
        Never raises for a missing endpoint (that field stays unknown); raises
        ``EngineUnavailable`` when the replica cannot be reached at all."""
        ...


def model_card(body: Any) -> dict:
    """The first entry of an OpenAI ``/v1/models`` list (vLLM and SGLang both add
    ``max_model_len`` and ``root``), or {} when the body has none."""
    if not isinstance(body, dict):
        return {}
    data = body.get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return {}
    return data[0]


def positive_int(value: Any) -> int | None:
    """``value`` as a positive int (a context length), else None."""
    if isinstance(value, bool):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        return None
    return n if n > 0 and n == value else None


def config_ties_head(config: Any) -> bool | None:
    """``tie_word_embeddings`` from an HF config dict, looking into nested text configs
    (multimodal models keep it there); None when the config does not say."""
    if not isinstance(config, dict):
        return None
    value = config.get("tie_word_embeddings")
    if isinstance(value, bool):
        return value
    for key in ("text_config", "llm_config", "language_config"):
        nested = config_ties_head(config.get(key))
        if nested is not None:
            return nested
    return None


def prefill_values(seg: Segment, input_ids: list[int], start: int, replica: str) -> list[float]:
    """Logprobs for absolute positions ``start..len(input_ids)-1`` from a prefill segment."""
    want = len(input_ids) - start
    offset = start - seg.input_logprobs_start
    values = seg.input_logprobs[offset : offset + want] if offset >= 0 else []
    if len(values) != want or any(v is None for v in values):
        raise EngineBadResponse(
            f"{replica}: prefill returned {len(values)} usable logprobs for {want} positions", replica=replica
        )
    return [float(v) for v in values]  # type: ignore[arg-type]
