"""Generation through ``EnginePool``: the abort-resume loop (R1; a paused engine's partial reply is
held and re-sent under the version current at resume) and prefill-only logprobs (R2)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Sequence

from engines.client import TokensCallback
from engines.replica import Replica
from engines.resume import Stitcher, parse_version
from engines.types import (
    EngineImage,
    EngineError,
    EnginePaused,
    EngineUnavailable,
    EngineVersionChanged,
    Generation,
    SamplingParams,
)

log = logging.getLogger("engines.pool")  # one logger for the pool, whichever file logs

_MAX_IDLE_BACKOFF_S = 1.0


class GenerationMixin:
    """``generate`` and ``prefill_logprobs`` of ``EnginePool`` (its state lives there)."""

    # -- generation (R1) ------------------------------------------------------------------------

    async def _wait_resumed(self) -> None:
        if not self._resumed.is_set():
            self._held += 1
            try:
                await self._resumed.wait()
            finally:
                self._held -= 1
        if self._closed:
            raise EngineUnavailable("the engine pool is closed")

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str,
        on_tokens: TokensCallback | None = None,
        prompt_logprobs_from: int | None = None,
        images: Sequence[EngineImage] = (),
    ) -> Generation:
        """Generate until stop / length, riding through any number of pause-abort-resume cycles.

        ``on_tokens(ids, logprobs)`` receives output tokens as they are
        sampled (the call streams from the engine then). Raises ``EngineError``; its
        ``retryable`` is False once any token was produced.

        ``prompt_logprobs_from=k`` (1 <= k < len(input_ids)) also asks the first engine call for
        the input logprobs of prompt positions k.. (R2 on a session's next turn), returned in
        ``Generation.prompt_logprobs`` with the version that computed them. Only ask when a
        token there is owed a value: input logprobs cap the engine's prefix cache.

        ``images``: every image of ``input_ids`` (``EngineImage`` spans over the expanded ids,
        prompt order). Every engine call of the generation carries them, resumes included.
        """
        if prompt_logprobs_from is not None and not 1 <= prompt_logprobs_from < len(input_ids):
            prompt_logprobs_from = None  # nothing placeable: a plain call
        if self._closed:
            raise EngineUnavailable("the engine pool is closed")
        if self._info.context_length is not None:
            params = replace(params, max_new_tokens=self.max_new_tokens(len(input_ids), params.max_new_tokens))
        stitch = Stitcher(input_ids, params, prompt_logprobs_from=prompt_logprobs_from, images=tuple(images))
        delivered = 0

        async def counting(ids: list[int], logprobs: list[float]) -> None:
            nonlocal delivered
            delivered += len(ids)
            await on_tokens(ids, logprobs)

        cb: TokensCallback | None = counting if on_tokens is not None else None

        replica: Replica | None = None
        backoff = 0.0
        self._in_flight += 1
        try:
            while True:
                await self._wait_resumed()
                sent_version = self._version
                frm = stitch.logprobs_from(sent_version)
                body_ids = stitch.next_input_ids()
                body_params = stitch.next_params()
                body_images = stitch.next_images()
                rid = f"splice-{session_id[:64]}-{uuid.uuid4().hex[:12]}"
                t0 = time.perf_counter()

                async def call(r: Replica) -> Any:
                    if body_images:
                        return await r.client.generate(
                            body_ids, body_params, rid=rid, input_logprobs_from=frm, on_tokens=cb, routing_key=session_id,
                            images=body_images,
                        )
                    return await r.client.generate(
                        body_ids, body_params, rid=rid, input_logprobs_from=frm, on_tokens=cb, routing_key=session_id
                    )

                try:
                    if replica is None or replica.out_of_rotation is not None:
                        # first segment, or its replica's weights are being replaced: pick by
                        # session, fail over once
                        replica, seg = await self._call_with_failover(
                            session_id, call, may_retry=lambda: delivered == 0
                        )
                    else:  # a resume stays where its tokens were produced
                        replica.in_flight += 1
                        try:
                            seg = await call(replica)
                        except EngineError as exc:
                            self._note_error(replica, exc)
                            raise
                        finally:
                            replica.in_flight -= 1
                except EngineError as exc:
                    if stitch.generated or delivered:
                        exc.retryable = False
                    raise
                finally:
                    stitch.gen.engine_time_s += time.perf_counter() - t0
                replica.healthy = True
                seg = await self._engine_version(replica, seg)
                stitch.add(seg, sent_version)
                if stitch.settle():
                    break
                if self._resumed.is_set():
                    # Aborted although Splice did not pause (someone paused the engine directly):
                    # re-send; the engine holds it until it continues. Back off if it keeps aborting.
                    await asyncio.sleep(backoff)
                    backoff = min(_MAX_IDLE_BACKOFF_S, backoff * 2 or 0.05)
                else:
                    backoff = 0.0
        finally:
            self._in_flight -= 1
        gen = stitch.gen
        gen.replica = replica.url
        gen.check()
        return gen

    async def _read_version(self, replica: Replica) -> str | None:
        """The replica's weight version read from the engine now (vLLM ``/weight_info``), for a
        reply that did not carry one; None when the engine cannot say."""
        if not replica.reports_version:
            return None
        try:
            reported = await replica.client.weight_version()
        except Exception as exc:  # noqa: BLE001 - a fact we cannot read falls back to V
            log.debug("could not read the weight version of %s: %r", replica.url, exc)
            return None
        if reported is None:
            replica.reports_version = False  # no /weight_info (vLLM without dev mode): stop asking
            return None
        v = parse_version(reported)
        if v is not None:
            replica.version = v
        return reported

    async def _engine_version(self, replica: Replica, seg: Any) -> Any:
        """``seg`` with the engine's weight version filled in where the reply had none.

        vLLM completions carry no version, so it is read from ``/weight_info`` right after the
        call: weights only change while the engine is paused and a pause aborts running calls,
        so a call that completed ran under the version the engine reports next (an update that
        slipped in between would need a whole pause and load, which is far slower than this
        read). An aborted call's tokens are stamped the same way: the abort came from the pause
        that precedes any load. Falls back to the pool's V when the engine does not say.
        """
        if seg.weight_version is not None:
            v = parse_version(seg.weight_version)
            if v is not None:
                replica.version = v
            return seg
        if not seg.output_ids and not seg.input_logprobs:
            return seg
        reported = await self._read_version(replica)
        return seg if reported is None else replace(seg, weight_version=reported)

    # -- prefill (R2) ---------------------------------------------------------------------------

    async def prefill_logprobs(
        self, input_ids: list[int], start: int, *, session_id: str, images: Sequence[EngineImage] = ()
    ) -> list[float]:
        """log pi_V(x_k | x_<k) for every k in [start, len(input_ids)), V = ``self.version``.
        ``images``: every image of ``input_ids`` (as for ``generate``); values at image pad
        positions are the engine's, never owed.

        Raises ``EnginePaused`` while paused (the engines would hold the call until resume) and
        ``EngineVersionChanged`` if the weights changed while it ran, so a value is never
        credited to the wrong version.
        """
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"start must be in [1, {len(input_ids)}], got {start}")
        if start == len(input_ids):
            return []
        if self._paused:
            raise EnginePaused("engines are paused; prefill after resume")
        version = self._version
        ids = list(input_ids)
        imgs = tuple(images)

        async def call(r: Replica):
            async with self._prefill_slot(r):  # bounded per replica: turns keep their share
                self.prefill_calls += 1
                self.prefill_tokens += len(ids)
                if imgs:
                    return await r.client.prefill(ids, start, routing_key=session_id, images=imgs)
                return await r.client.prefill(ids, start, routing_key=session_id)

        replica, (values, reported) = await self._call_with_failover(session_id, call, may_retry=lambda: True)
        if reported is None:
            reported = await self._read_version(replica)
        engine_version = parse_version(reported)
        if self._version != version or (engine_version is not None and engine_version != version):
            raise EngineVersionChanged(
                f"weights changed during the prefill (pool v{self._version}, engine {reported}, sent at v{version})"
            )
        return values

    def _prefill_slot(self, r: Replica) -> asyncio.Semaphore:
        slot = self._prefill_slots.get(r.url)
        if slot is None:
            slot = self._prefill_slots[r.url] = asyncio.Semaphore(self.prefill_concurrency)
        return slot
