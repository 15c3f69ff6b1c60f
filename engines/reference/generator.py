"""The model worker: one thread that owns the model and interleaves every active request.

Each request (``Job``) has its own KV cache. The worker prefills newly admitted jobs and then
round-robins single decode steps across all active ones, so several requests progress at
once and a pause or abort lands between two tokens of a generation, as on a real server.
Everything that touches a job's state or the model happens on this thread; other threads talk
to it through ``_post`` (a message queue) and read results through ``Job.snapshot``.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from .lm import LanguageModel
from .prefix_cache import PrefixCache
from .sampling import GenParams, apply_logit_bias, sample, token_logprobs
from .script import Script

log = logging.getLogger(__name__)

TopList = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass(frozen=True)
class Finish:
    """Why a job ended: ``type`` is "stop" | "length" | "abort"; ``matched`` the stop id or string."""

    type: str
    matched: int | str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Snapshot:
    """A consistent copy of a job's results at one moment (what an HTTP frame is built from)."""

    output_ids: list[int]
    output_logprobs: list[float]
    output_top: list[TopList]
    output_ranks: list[int]
    input_logprobs: list[float | None]
    input_top: list[TopList | None]
    input_ranks: list[int | None]
    finish: Finish | None
    weight_version: str


@dataclass(eq=False)
class Job:
    """One generation request. Fields below ``on_update`` are written by the worker only."""

    rid: str
    input_ids: list[int]
    params: GenParams
    input_logprobs_from: int | None = None  # first prompt position to report; None: none
    input_top_logprobs: int = 0
    images: tuple = ()  # vision.ImageSpan per image of input_ids (expanded), prompt order
    on_update: Callable[[], None] | None = None  # called on the worker thread after each change

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopList] = field(default_factory=list)
    output_ranks: list[int] = field(default_factory=list)  # 1 = the most likely token
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopList | None] = field(default_factory=list)
    input_ranks: list[int | None] = field(default_factory=list)  # 1 = the most likely token
    finish: Finish | None = None
    weight_version: str = ""
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (set at admission)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    done: threading.Event = field(default_factory=threading.Event, repr=False)

    _cache: object = None
    _logits: torch.Tensor | None = None
    _due: float = 0.0
    _gen: torch.Generator | None = None
    _script: tuple[int, int] | None = None  # (entry, start offset) in script mode
    _epoch: int = -1  # the prefix cache's epoch at admission (-1: not cacheable)

    def snapshot(self) -> Snapshot:
        with self.lock:
            return Snapshot(
                list(self.output_ids),
                list(self.output_logprobs),
                list(self.output_top),
                list(self.output_ranks),
                list(self.input_logprobs),
                list(self.input_top),
                list(self.input_ranks),
                self.finish,
                self.weight_version,
            )


def _top(lsm: torch.Tensor, k: int) -> TopList:
    if k <= 0:
        return []
    vals, ids = torch.topk(lsm, k)
    return [(int(i), float(v)) for i, v in zip(ids, vals)]


class Worker:
    """Owns the ``LanguageModel``; runs jobs, pauses, aborts and weight updates in order."""

    def __init__(
        self,
        lm: LanguageModel,
        *,
        script: Script | None = None,
        token_delay_s: float = 0.0,
        weight_version: str = "0",
        seed: int = 0,
        prefix_cache: PrefixCache | None = None,
    ):
        self.lm = lm
        # KV of recent sequences (text models only: a vision prompt's KV depends on its images)
        self.prefix = prefix_cache if prefix_cache is not None and prefix_cache.enabled and lm.vision is None else None
        self.script = script
        self.token_delay_s = float(token_delay_s)
        self.weight_version = str(weight_version)
        self.model_path = lm.model_dir
        self.weight_loads = 0  # successful weight loads since start (a debug counter: /model_info)
        self.weight_load_versions: list[str | None] = []  # the version named by each load, in order
        self.tensor_updates = 0  # successful /update_weights_from_distributed calls (buckets)
        self._seeds = random.Random(seed)
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._queued: collections.deque[Job] = collections.deque()
        self._active: list[Job] = []
        self._paused = False
        self._update: tuple | None = None  # a weight update waiting for the active jobs to stop
        self._waiters: list[Future] = []  # futures resolved when nothing is queued or active
        self._stopped = False
        self._stop_tail: dict[tuple[str, ...], int] = {}  # stop strings -> tokens of output to decode
        self._thread = threading.Thread(target=self._run, name="reference-engine-worker", daemon=True)

    # ---- API for other threads -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Abort everything and end the thread."""
        self._post("stop").result(timeout=30)
        self._thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        """Queue ``job``; it is admitted in arrival order."""
        self._post("submit", job)

    def abort(self, rid: str | None) -> Future:
        """Abort one job by rid (or all with ``None``); resolves to the number aborted."""
        return self._post("abort", rid)

    def pause(self, mode: str) -> Future:
        """Mode "abort": abort every job and hold; "in_place": stop stepping, keep state."""
        return self._post("pause", mode)

    def resume(self) -> Future:
        return self._post("resume")

    def drain(self) -> Future:
        """Resolves once nothing is queued or active."""
        return self._post("drain")

    def update_weights(self, path: str, version: str | None, *, abort_all: bool = False) -> Future:
        """Load weights from ``path`` once no job is being stepped; resolves to (success, message)."""
        return self._post("update", path, version, abort_all)

    def load_tensors(self, tensors: dict, version: str | None, *, abort_all: bool = False) -> Future:
        """Copy received tensors (one bucket of a broadcast) into the model once no job is being
        stepped, as ``update_weights`` does; ``version`` (the last bucket's) is then stamped."""
        return self._post("update", tensors, version, abort_all)

    def call(self, fn) -> Future:
        """Run ``fn()`` on the worker thread, between decode steps (reads of the weights)."""
        return self._post("call", fn)

    @property
    def paused(self) -> bool:
        return self._paused

    def load(self) -> dict:
        """Counts for /get_server_info and the tests."""
        with self._cond:
            return {"queued": len(self._queued), "active": len(self._active), "paused": self._paused}

    def _post(self, kind: str, *args) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                fut.set_exception(RuntimeError("engine worker stopped"))
                return fut
            self._inbox.append((kind, args, fut))
            self._cond.notify()
        return fut

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._inbox and not self._work_now():
                    self._cond.wait(timeout=self._wait_s())
                msgs = list(self._inbox)
                self._inbox.clear()
            for kind, args, fut in msgs:
                if kind == "stop":
                    self._abort_all("engine shutting down")
                    with self._cond:
                        self._stopped = True
                        rest = list(self._inbox)
                        self._inbox.clear()
                    for _, _, f in rest:
                        f.set_exception(RuntimeError("engine worker stopped"))
                    fut.set_result(None)
                    return
                try:
                    self._handle(kind, args, fut)
                except Exception as e:  # never let one message kill the worker
                    log.exception("worker message %s failed", kind)
                    if not fut.done():
                        fut.set_exception(e)
            try:
                self._tick()
            except Exception:
                log.exception("worker step failed")
                self._abort_all("internal error in the reference engine")

    def _work_now(self) -> bool:
        if self._update is not None and (self._paused or not self._active):
            return True
        if self._waiters and not self._queued and not self._active:
            return True
        if self._paused:
            return False
        if self._queued and self._update is None:
            return True
        now = time.monotonic()
        return any(j._due <= now for j in self._active)

    def _wait_s(self) -> float | None:
        if self._paused or not self._active:
            return None
        return max(0.0, min(j._due for j in self._active) - time.monotonic())

    def _handle(self, kind: str, args: tuple, fut: Future) -> None:
        if kind == "submit":
            with self._cond:
                self._queued.append(args[0])
            fut.set_result(None)
        elif kind == "abort":
            fut.set_result(self._abort(args[0], "Aborted by request" if args[0] else "Aborted all requests"))
        elif kind == "pause":
            mode = args[0]
            if mode == "abort":
                self._abort_all("Aborted by pause_generation")
            self._paused = True
            fut.set_result(None)
        elif kind == "resume":
            self._paused = False
            now = time.monotonic()
            for j in self._active:
                j._due = max(j._due, now)
            fut.set_result(None)
        elif kind == "call":
            fut.set_result(args[0]())
        elif kind == "drain":
            self._waiters.append(fut)
        elif kind == "update":
            path, version, abort_all = args
            if self._update is not None:
                fut.set_result((False, "another weight update is in progress"))
                return
            if abort_all:
                self._abort_all("Aborted by a weight update")
            self._update = (path, version, fut)

    def _tick(self) -> None:
        if self._update is not None and (self._paused or not self._active):
            self._do_update()
        if self._waiters and not self._queued and not self._active:
            for f in self._waiters:
                f.set_result(None)
            self._waiters.clear()
        if self._paused:
            return
        if self._queued and self._update is None:
            with self._cond:
                job = self._queued.popleft()
            self._admit(job)
        now = time.monotonic()
        for job in list(self._active):
            if job._due <= now and job.finish is None:
                self._step(job)

    def _do_update(self) -> None:
        source, version, fut = self._update
        self._update = None
        from_disk = isinstance(source, str)
        try:
            if from_disk:
                self.lm.load_weights(source)
            else:
                self.lm.load_tensors(source, partial=True)
        except Exception as e:
            fut.set_result((False, f"Failed to update weights: {e}"))
            return
        if self.prefix is not None:  # KV computed with the old weights is no longer the model's
            self.prefix.clear()
        if from_disk:
            self.model_path = str(source)
        else:
            self.tensor_updates += 1
        if version is not None:
            self.weight_version = str(version)
        if from_disk or version is not None:  # a broadcast counts once, at its versioned last bucket
            self.weight_loads += 1
            self.weight_load_versions.append(None if version is None else str(version))
        fut.set_result((True, "Succeeded to update model weights." if from_disk else "Succeeded to update parameter online."))

    # ---- jobs ------------------------------------------------------------------------------

    def _admit(self, job: Job) -> None:
        """Prefill ``job``: input logprobs if asked, next-token logits, script entry."""
        ids = job.input_ids
        start = job.input_logprobs_from
        keep_from = len(ids) - 1 if start is None else min(start, len(ids) - 1)
        hit = None
        if self.prefix is not None and not job.images:
            job._epoch = self.prefix.epoch
            hit = self.prefix.lookup(ids, limit=keep_from)  # hidden states from keep_from on are computed
        job._cache = hit.cache if hit is not None else self.lm.new_cache()
        job.cached_tokens = hit.tokens if hit is not None else 0
        try:
            reuse = {"start": job.cached_tokens} if job.cached_tokens else {}
            hidden = self.lm.prefill(ids, job._cache, keep_from=keep_from, images=job.images, **reuse)
        except ValueError as e:  # a request the model cannot take (checked before admission; a backstop)
            job._epoch = -1
            self._finish(job, Finish("abort", message=f"prefill failed: {e}"))
            return
        input_lps: list[float | None] = []
        input_top: list[TopList | None] = []
        input_ranks: list[int | None] = []
        last_logits = None
        for off, logits in self.lm.logits(hidden):
            first = keep_from + off  # row r predicts position first + r + 1
            if start is not None:
                n = min(logits.shape[0], len(ids) - 1 - first)  # rows that predict a prompt token
                if n > 0:
                    lsm = torch.log_softmax(logits[:n], dim=-1)  # prompt logprobs: never temperature-scaled
                    targets = torch.tensor(ids[first + 1 : first + 1 + n])
                    chosen = lsm.gather(1, targets[:, None])
                    input_lps.extend(chosen[:, 0].tolist())
                    input_ranks.extend((1 + (lsm > chosen).sum(dim=1)).tolist())
                    if job.input_top_logprobs:
                        input_top.extend(_top(row, job.input_top_logprobs) for row in lsm)
            if first + logits.shape[0] == len(ids):
                last_logits = logits[-1].clone()
        if start is not None:
            input_lps.insert(0, None)
            input_ranks.insert(0, None)
            if job.input_top_logprobs:
                input_top.insert(0, None)
        job._logits = last_logits
        seed = job.params.seed if job.params.seed is not None else self._seeds.getrandbits(63)
        job._gen = torch.Generator().manual_seed(int(seed))
        with job.lock:
            job.input_logprobs = input_lps
            job.input_top = input_top
            job.input_ranks = input_ranks
        if job.params.max_new_tokens == 0:
            self._finish(job, Finish("length"))
            return
        if len(ids) >= self.lm.context_len:
            self._finish(job, Finish("length"))
            return
        if self.script is not None:
            job._script = self.script.assign(ids)
        job._due = time.monotonic() + self.token_delay_s
        self._active.append(job)
        self._notify(job)

    def _choose(self, job: Job, logits: torch.Tensor) -> int:
        if job._script is not None:
            entry, startpos = job._script
            return self.script.entries[entry][startpos + len(job.output_ids)]
        return sample(logits, job.params, job._gen)

    def _step(self, job: Job) -> None:
        """Emit one token for ``job``, then either finish it or feed the token back."""
        p = job.params
        biased = apply_logit_bias(job._logits, p)
        tok = self._choose(job, biased)
        lsm = token_logprobs(biased if p.bias_logprobs else job._logits, p)
        lp = float(lsm[tok])
        rank = int((lsm > lsm[tok]).sum()) + 1
        top = _top(lsm, p.top_logprobs)
        with job.lock:
            job.output_ids.append(tok)
            job.output_logprobs.append(lp)
            job.output_ranks.append(rank)
            if p.top_logprobs:
                job.output_top.append(top)
        finish = self._check_finish(job, tok)
        if finish is not None:
            self._finish(job, finish)
            return
        job._logits = self.lm.step(tok, job._cache)
        job._due = max(job._due + self.token_delay_s, time.monotonic()) if self.token_delay_s else 0.0
        self._notify(job)

    def _check_finish(self, job: Job, tok: int) -> Finish | None:
        p = job.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.lm.eos_ids):
            return Finish("stop", tok)
        if p.stop:
            matched = self._match_stop_str(job.output_ids, p.stop)
            if matched is not None:
                return Finish("stop", matched)
        if job._script is not None:
            entry, startpos = job._script
            if startpos + len(job.output_ids) >= len(self.script.entries[entry]):
                return Finish("stop", tok if tok in self.lm.eos_ids else None)
        if len(job.output_ids) >= p.max_new_tokens:
            return Finish("length")
        if len(job.input_ids) + len(job.output_ids) >= self.lm.context_len:
            return Finish("length")
        return None

    def _match_stop_str(self, out: list[int], stops: tuple[str, ...]) -> str | None:
        """First stop string present in the decoded tail of the output (as SGLang checks)."""
        tail_len = self._stop_tail.get(stops)
        if tail_len is None:
            tail_len = max(len(self.lm.tokenizer.encode(s, add_special_tokens=False)) for s in stops) + 2
            self._stop_tail[stops] = tail_len
        tail = self.lm.tokenizer.decode(out[-tail_len:])
        for s in stops:
            if s and s in tail:
                return s
        return None

    def _finish(self, job: Job, finish: Finish) -> None:
        if job._script is not None and finish.type == "abort":
            entry, startpos = job._script
            done = startpos + len(job.output_ids)
            self.script.record_abort(entry, done, job.input_ids + job.output_ids)
        with job.lock:
            job.finish = finish
            job.weight_version = self.weight_version
        if self.prefix is not None and job._cache is not None and job._epoch >= 0:
            self.prefix.insert(job.input_ids + job.output_ids, job._cache, job._epoch)
        job._cache = None
        job._logits = None
        if job in self._active:
            self._active.remove(job)
        job.done.set()
        self._notify(job)

    def _abort(self, rid: str | None, message: str) -> int:
        n = 0
        with self._cond:
            queued = [j for j in self._queued if rid is None or j.rid == rid]
            for j in queued:
                self._queued.remove(j)
        for j in queued + [j for j in self._active if rid is None or j.rid == rid]:
            self._finish(j, Finish("abort", message=message))
            n += 1
        return n

    def _abort_all(self, message: str) -> None:
        self._abort(None, message)

    @staticmethod
    def _notify(job: Job) -> None:
        if job.on_update is not None:
            try:
                job.on_update()
            except Exception:  # the HTTP side went away; the job still finishes
                log.debug("on_update failed for %s", job.rid, exc_info=True)
