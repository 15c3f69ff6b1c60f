"""Buckets of a weight broadcast (trainer_bridge.weight_transfer): bounded, in order, the last
one known to be last, at most one tensor read ahead."""

from __future__ import annotations

import pytest
import torch

from trainer_bridge.weight_transfer import buckets, dtype_name

MB = 2**20


def _named(sizes_mb: list[float]) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{i}", torch.full((int(s * MB) // 4,), float(i), dtype=torch.float32)) for i, s in enumerate(sizes_mb)]


@pytest.mark.parametrize("sizes", [[0.5] * 7, [3.0, 0.25, 0.25, 5.0, 1.0], [1.0], [0.1, 0.1, 2.5]])
def test_buckets_are_bounded_ordered_and_flag_first_and_last(sizes):
    named = _named(sizes)
    got = list(buckets(iter(named), 2 * MB))
    assert [n for b in got for n in b.names] == [n for n, _ in named]
    for b in got:
        assert b.nbytes <= 2 * MB or len(b.tensors) == 1  # a tensor larger than a bucket goes alone
    assert [b.first for b in got] == [True] + [False] * (len(got) - 1)
    assert [b.final for b in got] == [False] * (len(got) - 1) + [True]
    for b in got:
        assert b.shapes == [list(t.shape) for _, t in b.tensors] and set(b.dtypes) == {"float32"}


def test_at_most_one_tensor_is_read_ahead_of_what_was_sent():
    named = _named([0.75] * 8)
    pulled = 0

    def lazy():
        nonlocal pulled
        for item in named:
            pulled += 1
            yield item

    sent = 0
    for b in buckets(lazy(), 2 * MB):
        sent += len(b.tensors)
        assert pulled <= sent + 1
    assert sent == 8


def test_cast_to_the_engine_dtype_and_empty_input():
    (b,) = list(buckets(iter([("x", torch.ones(3, dtype=torch.float32))]), MB, dtype=torch.bfloat16))
    assert b.dtypes == ["bfloat16"] and b.tensors[0][1].dtype == torch.bfloat16
    assert list(buckets(iter([]), MB)) == []
    assert dtype_name(torch.float16) == "float16"


def test_auto_picks_the_broadcast_only_when_every_engine_speaks_sglangs_weight_api():
    from trainer_bridge.weight_transfer import choose_transfer

    sg, vl = {"engines": {"kind": "sglang"}}, {"engines": {"kind": "vllm"}}
    assert choose_transfer([sg, sg]) == "distributed"
    assert choose_transfer([sg, vl]) == "disk"
    assert choose_transfer([{"version": 3}]) == "disk"  # a proxy that does not say
    assert choose_transfer([vl], "distributed") == "distributed" and choose_transfer([sg], "disk") == "disk"
    with pytest.raises(ValueError):
        choose_transfer([sg], "nfs")


def test_full_tensors_names_and_dtype_of_a_plain_model():
    from trainer_bridge.weight_transfer import full_tensors

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    got = list(full_tensors(model, dtype=torch.bfloat16))
    assert [n for n, _ in got] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    for (n, t), (_, p) in zip(got, model.named_parameters()):
        assert t.dtype == torch.bfloat16 and torch.equal(t, p.detach().to(torch.bfloat16)) and not t.requires_grad


def test_demo_summary_records_the_transfer_and_seconds_per_publish():
    from proxy.demo.report import weight_transfer_summary

    stats = [{"publish_time_s": 0.5, "weight_transfer": "distributed"}, {"publish_time_s": 0.25, "weight_transfer": "distributed"}]
    assert weight_transfer_summary(stats) == {"modes": ["distributed"], "publish_s": [0.5, 0.25], "publish_s_mean": 0.375}
    assert weight_transfer_summary([]) == {"modes": [], "publish_s": [], "publish_s_mean": None}


def test_a_distributed_publish_to_vllm_engines_stops_before_pausing_anything():
    import httpx

    from trainer_bridge.client import ProxyClient
    from trainer_bridge.publish import PublishError, publish_tensors

    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        reps = [{"id": "http://vllm-a:8000", "url": "http://vllm-a:8000", "healthy": True, "stale": False, "weight_version": 0}]
        return httpx.Response(200, json={"version": 0, "engines": {"kind": "vllm", "engine_replicas": reps}})

    client = ProxyClient(["http://p1:8000"], transport=httpx.MockTransport(handler), max_retries=0)
    read = []

    def gathered():  # a sharded trainer's gathers: read to the end even when nothing is sent
        for k in range(3):
            read.append(k)
            yield f"w{k}", torch.ones(2)

    with pytest.raises(PublishError) as err:
        publish_tensors(client.urls, gathered(), 1, client=client, backend="gloo")
    assert err.value.step == "status" and "disk" in str(err.value)
    assert calls == ["/admin/status"]  # nothing paused
    assert read == [0, 1, 2]
