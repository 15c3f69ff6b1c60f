"""Pieces of the engine without HTTP: script bookkeeping, sampler, text trimming, the worker queue."""

from __future__ import annotations

import pytest
import torch

from engines.reference.generator import Finish, Job, Worker
from engines.reference.lm import LanguageModel
from engines.reference.sampling import GenParams, sample
from engines.reference.script import Script
from engines.reference.text import output_text


def test_script_assigns_in_order_and_resumes_aborted_entries():
    s = Script([[1, 2, 3, 4], [5, 6, 7], [8, 9]])
    assert s.assign([100]) == (0, 0)
    s.record_abort(0, 2, [100, 1, 2])
    assert s.assign([100, 1, 2]) == (0, 2)  # exact re-send resumes
    assert s.assign([100]) == (1, 0)
    s.record_abort(1, 0, [100])  # aborted before its first token
    assert s.assign([100]) == (1, 0)
    s.record_abort(1, 1, [100, 5])
    assert s.assign([7, 7, 5]) == (1, 1)  # input ends with the emitted part: resumes too
    assert s.assign([1]) == (2, 0)
    assert s.assign([1]) == (0, 0)  # cycles


def test_sampler_respects_top_k_top_p_min_p():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, -5.0])
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, GenParams(top_k=2), g) for _ in range(200)} == {0, 1}
    assert {sample(logits, GenParams(top_p=0.5), g) for _ in range(200)} == {0}
    assert {sample(logits, GenParams(min_p=0.5), g) for _ in range(200)} <= {0, 1}
    assert sample(logits, GenParams(temperature=0.0), g) == 0
    counts = torch.bincount(torch.tensor([sample(logits, GenParams(), g) for _ in range(4000)]), minlength=5).float()
    assert torch.allclose(counts / 4000, torch.softmax(logits, 0), atol=0.03)


class FakeTok:
    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True):
        return "".join("<E>" if i == 0 and not skip_special_tokens else "" if i == 0 else chr(96 + i) for i in ids)


def test_output_text_trimming_and_hold_back():
    tok = FakeTok()
    ids = [1, 2, 19, 20, 3]  # "abstc"
    assert output_text(tok, ids, Finish("stop", "st"), stop=("st",)) == "ab"
    assert output_text(tok, ids, Finish("stop", "st"), stop=("st",), trim_stop_str=False) == "abstc"
    assert output_text(tok, [1, 2, 19], None, stop=("st",)) == "ab"  # "s" may start the stop string
    assert output_text(tok, [1, 0], Finish("stop", 0), skip_special_tokens=False, trim_stop_token=True) == "a"
    assert output_text(tok, [1, 0], Finish("stop", 0), skip_special_tokens=False) == "a<E>"


@pytest.fixture(scope="module")
def lm(model_dir):
    return LanguageModel(model_dir)


def test_worker_aborts_queued_job_with_empty_output(lm):
    w = Worker(lm)
    w.start()
    try:
        w.pause("in_place").result(timeout=10)
        job = Job(rid="q", input_ids=[1, 2, 3], params=GenParams(max_new_tokens=5))
        w.submit(job)
        assert w.load()["queued"] == 1 or not job.done.is_set()
        w.pause("abort").result(timeout=10)
        assert job.done.wait(5)
        snap = job.snapshot()
        assert snap.finish.type == "abort" and snap.output_ids == [] and snap.output_logprobs == []
    finally:
        w.stop()


def test_worker_update_while_paused_in_place_keeps_jobs(lm, model_dir):
    w = Worker(lm, token_delay_s=0.01, weight_version="1")
    w.start()
    try:
        job = Job(rid="a", input_ids=[1, 2, 3], params=GenParams(max_new_tokens=50))
        w.submit(job)
        while not job.snapshot().output_ids:
            job.done.wait(0.01)
        w.pause("in_place").result(timeout=10)
        n = len(job.snapshot().output_ids)
        assert w.update_weights(str(model_dir), "2").result(timeout=30) == (True, "Succeeded to update model weights.")
        assert len(job.snapshot().output_ids) == n and not job.done.is_set()
        w.resume().result(timeout=10)
        assert job.done.wait(10)
        snap = job.snapshot()
        assert len(snap.output_ids) == 50 and snap.weight_version == "2"
    finally:
        w.stop()
