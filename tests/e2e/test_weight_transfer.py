"""Weights over torch.distributed (docs/weight_transfer.md), real processes over loopback (gloo).

Two reference engines A and B; proxy P1 drives A, proxy P2 drives A and B (A is shared). The
trainer side is this test process (``trainer_bridge.publish.publish_tensors``), or a child
process that is killed half way through a transfer. Every expected value comes from outside
Splice: the published safetensors themselves, and a third reference engine that loaded the
same weights from disk at start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import ROOT, kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

BUCKET_MB = 2.0
PROMPT = "The weights arrive over a process group, not a filesystem; every token must be scored by them."


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def weights(tmp_path_factory, model_dir):
    from engines.reference.model_init import perturb_model

    root = tmp_path_factory.mktemp("xfer-weights")
    return {v: str(perturb_model(model_dir, root / f"v{v}", seed=300 + v, scale=0.05)) for v in (1, 2, 3)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dir):
    from engines.reference.launch import start_engine

    stops, proxies = [], []
    try:
        a, stop_a = start_engine(model_dir, timeout_s=120)
        stops.append(stop_a)
        b, stop_b = start_engine(model_dir, timeout_s=120)
        stops.append(stop_b)
        tmp = tmp_path_factory.mktemp("xfer")
        proxies.append(start_proxy(tmp, model_dir, extra=["--engine-url", a], store=str(tmp / "p1.sqlite")))
        proxies.append(start_proxy(tmp, model_dir, extra=["--engine-url", a, "--engine-url", b], store=str(tmp / "p2.sqlite")))
        yield {"a": a, "b": b, "proxies": proxies, "urls": [p.url for p in proxies]}
    finally:
        for p in proxies:
            kill_tree(p)
        for stop in stops:
            stop()


@pytest.fixture(scope="module")
def sender():
    from trainer_bridge.weight_transfer import WeightSender

    s = WeightSender(master_address="127.0.0.1", backend="gloo", timeout_s=120)
    yield s
    s.close()


def _info(engine: str) -> dict:
    return httpx.get(engine + "/model_info", timeout=30).json()


def _weight(engine: str, name: str, rows: int = 10**9):
    import torch

    r = httpx.post(engine + "/get_weights_by_name", json={"name": name, "truncate_size": rows}, timeout=120)
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


def _prompt_logprobs(engine: str) -> list[float]:
    r = httpx.post(
        engine + "/generate",
        json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return [e[0] for e in r.json()["meta_info"]["input_token_logprobs"][1:]]


def _status(url: str) -> dict:
    return httpx.get(url + "/admin/status", headers=admin_headers(), timeout=30).json()


def _chat_versions(url: str) -> tuple[int, list[int]]:
    sid = "xfer-" + uuid.uuid4().hex[:10]
    r = httpx.post(
        url + "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6},
        timeout=120,
    )
    if r.status_code != 200:
        return r.status_code, []
    s = httpx.get(url + f"/v1/sessions/{sid}", headers=admin_headers(), timeout=30).json()
    return 200, [v for t in s["turns"] for v in t["versions"]]


def _assert_exact(engine: str, expected: dict, *, big_rows: int = 512) -> None:
    import torch

    for name, t in expected.items():
        rows = big_rows if t.numel() > 2_000_000 else 10**9  # the embedding: its first rows (the logprobs cover all)
        got = _weight(engine, name, rows)
        assert torch.equal(got, t.float()[:rows]), name


def test_broadcast_publish_gives_every_engine_the_exact_weights_once(fleet, weights, sender, model_dir):
    from engines.reference.launch import start_engine
    from trainer_bridge.publish import publish_tensors

    v1 = _tensors(weights[1])
    before = {e: _info(fleet[e]) for e in ("a", "b")}
    report = publish_tensors(fleet["urls"], iter(v1.items()), 1, sender=sender, bucket_mb=BUCKET_MB)
    assert report.ok and report.transfer == "distributed"
    assert sorted(report.loaded) == sorted([fleet["a"], fleet["b"]]) and report.failed == {}
    assert report.buckets >= 2 and report.groups_made == 2

    for e in ("a", "b"):
        info = _info(fleet[e])
        # A sits behind both proxies and still received v1 once: one versioned load, one group
        assert info["weight_version"] == "1"
        assert info["weight_load_versions"] == before[e]["weight_load_versions"] + ["1"]
        assert info["weight_update_groups_joined"] == 1 and len(info["weight_update_groups"]) == 1
        assert info["tensor_updates"] == before[e]["tensor_updates"] + report.buckets
        assert info["model_path"] == model_dir  # the engine was never told a path
        _assert_exact(fleet[e], v1)

    # the same weights loaded from disk by a fresh engine give the same logprobs, bit for bit
    ref_url, stop = start_engine(weights[1], timeout_s=120)
    try:
        expected = _prompt_logprobs(ref_url)
    finally:
        stop()
    for e in ("a", "b"):
        assert _prompt_logprobs(fleet[e]) == expected

    for url in fleet["urls"]:
        st = _status(url)
        assert st["version"] == 1 and st["paused"] is False and st["out_of_rotation"] == {}
        code, versions = _chat_versions(url)
        assert code == 200 and versions and set(versions) == {1}


def test_second_publish_keeps_the_groups_and_stamps_the_new_version(fleet, weights, sender):
    from trainer_bridge.publish import publish_tensors

    v2 = _tensors(weights[2])
    report = publish_tensors(fleet["urls"], iter(v2.items()), 2, sender=sender, bucket_mb=BUCKET_MB)
    assert report.ok and report.groups_made == 0
    for e in ("a", "b"):
        info = _info(fleet[e])
        assert info["weight_version"] == "2" and info["weight_update_groups_joined"] == 1
        assert info["weight_load_versions"][-2:] == ["1", "2"]
        _assert_exact(fleet[e], v2, big_rows=64)
    again = publish_tensors(fleet["urls"], iter(v2.items()), 2, sender=sender, bucket_mb=BUCKET_MB)
    assert again.ok and sorted(again.skipped) == sorted([fleet["a"], fleet["b"]]) and again.loaded == []
    assert _info(fleet["a"])["weight_load_versions"][-2:] == ["1", "2"]  # re-running v2 moved nothing


CHILD = r"""
import sys, time
from pathlib import Path
from safetensors.torch import load_file
from trainer_bridge.publish import publish_tensors
urls, path, marker = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
tensors = {}
for f in sorted(Path(path).glob("*.safetensors")):
    tensors.update(load_file(str(f)))
items = list(tensors.items())
def gen():
    for k, item in enumerate(items):
        if k == len(items) // 2:
            Path(marker).write_text("half")
            time.sleep(600)
        yield item
publish_tensors(urls, gen(), 3, bucket_mb=0.25)
"""


def test_a_transfer_killed_half_way_leaves_no_mixed_engine_in_rotation(fleet, weights, tmp_path):
    import torch

    from trainer_bridge.publish import publish, publish_tensors
    from trainer_bridge.weight_transfer import WeightSender

    v2, v3 = _tensors(weights[2]), _tensors(weights[3])
    names = list(v3)
    marker = tmp_path / "half"
    before = {e: _info(fleet[e]) for e in ("a", "b")}
    last_before = {e: _weight(fleet[e], names[-1]) for e in ("a", "b")}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, ",".join(fleet["urls"]), weights[3], str(marker)],
        cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, "the publishing child exited early"
            assert time.monotonic() < deadline, "the transfer never got half way"
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()

    # the engines hold part v3, part what they had, and still say the version they had
    for e in ("a", "b"):
        info = _info(fleet[e])
        assert info["weight_version"] == before[e]["weight_version"] != "3"
        assert info["tensor_updates"] > before[e]["tensor_updates"]
        assert torch.equal(_weight(fleet[e], names[0], 64), v3[names[0]].float()[:64])
        assert torch.equal(_weight(fleet[e], names[-1]), last_before[e])
        assert not torch.equal(last_before[e], v3[names[-1]].float())
    # every proxy names them and sends them nothing, even once an operator resumes it
    for url in fleet["urls"]:
        st = _status(url)
        assert st["paused"] is True
        assert sorted(st["out_of_rotation"]) == sorted(r["id"] for r in st["engines"]["engine_replicas"])
        assert httpx.post(url + "/admin/resume", json={}, headers=admin_headers(), timeout=30).status_code == 200
        code, _ = _chat_versions(url)
        assert code == 503
    assert _info(fleet["a"])["weight_version"] == before["a"]["weight_version"]

    # the trainer retries: a complete publish of v3 puts every engine back, with v3 stamped
    fresh = WeightSender(master_address="127.0.0.1", backend="gloo", timeout_s=120)
    try:
        report = publish_tensors(fleet["urls"], iter(v3.items()), 3, sender=fresh, bucket_mb=BUCKET_MB)
    finally:
        fresh.close()
    assert report.ok and sorted(report.loaded) == sorted([fleet["a"], fleet["b"]])
    for e in ("a", "b"):
        _assert_exact(fleet[e], v3, big_rows=64)
        assert _info(fleet[e])["weight_version"] == "3"
    for url in fleet["urls"]:
        st = _status(url)
        assert st["out_of_rotation"] == {} and st["version"] == 3
        code, versions = _chat_versions(url)
        assert code == 200 and set(versions) == {3}

    # a bucket an engine rejects: both engines stay out, the version stays, nobody is paused,
    # and the error names them; falling back to the disk publish brings them back
    import pytest as _pytest

    from trainer_bridge.publish import PublishError

    bad = list(v2.items()) + [("model.not_a_weight", torch.zeros(3))]
    with _pytest.raises(PublishError) as err:
        publish_tensors(fleet["urls"], iter(bad), 4, bucket_mb=BUCKET_MB)
    assert err.value.step == "transfer" and sorted(err.value.engines) == sorted([fleet["a"], fleet["b"]])
    assert "model.not_a_weight" in str(err.value)
    for url in fleet["urls"]:
        st = _status(url)
        assert st["paused"] is False and st["version"] == 3 and len(st["out_of_rotation"]) == len(st["engines"]["engine_replicas"])
    assert publish(fleet["urls"], weights[2], 4).ok
    for url in fleet["urls"]:
        st = _status(url)
        assert st["out_of_rotation"] == {} and st["version"] == 4
        code, versions = _chat_versions(url)
        assert code == 200 and set(versions) == {4}
    _assert_exact(fleet["a"], v2, big_rows=64)


def test_splice_publish_cli_broadcasts_a_safetensors_directory(fleet, weights):
    import json as _json

    proxies = [a for url in fleet["urls"] for a in ("--proxy", url)]
    groups_before = {e: _info(fleet[e])["weight_update_groups"] for e in ("a", "b")}
    out = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "publish", *proxies, "--transfer", "distributed", "--weights", weights[1],
         "--version", "5", "--bucket-mb", "4", "--backend", "gloo", "--json"],
        cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = _json.loads(out.stdout)
    assert report["ok"] and report["transfer"] == "distributed" and report["model_path"] == ""
    assert sorted(report["loaded"]) == sorted([fleet["a"], fleet["b"]])
    v1 = _tensors(weights[1])
    for e in ("a", "b"):
        info = _info(fleet[e])
        assert info["weight_version"] == "5"
        assert info["weight_update_groups"] == groups_before[e]  # a one-shot publish leaves no group behind
        _assert_exact(fleet[e], v1, big_rows=64)
    for url in fleet["urls"]:
        assert _status(url)["version"] == 5
    bad = subprocess.run(
        [sys.executable, "-m", "proxy.cli", "publish", *proxies, "--transfer", "distributed", "--version", "6"],
        cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--weights" in bad.stderr


def test_an_engine_that_restarts_gets_a_new_group(tmp_path, model_dir, weights):
    """The kept group dies with the engine; the next publish makes a new one (whether or not the
    proxy's health check saw the engine down) and the new process gets the whole weights."""
    from engines.reference.launch import start_engine
    from trainer_bridge.publish import publish_tensors
    from trainer_bridge.weight_transfer import WeightSender

    url, stop = start_engine(model_dir, timeout_s=120)
    port = int(url.rsplit(":", 1)[1])
    proxy = start_proxy(tmp_path, model_dir, extra=["--engine-url", url])
    sender = WeightSender(master_address="127.0.0.1", backend="gloo", timeout_s=120)
    try:
        assert publish_tensors([proxy.url], iter(_tensors(weights[1]).items()), 1, sender=sender, bucket_mb=BUCKET_MB).ok
        assert sender.groups_made == 1
        stop()
        url2, stop = start_engine(model_dir, port=port, timeout_s=120)
        assert url2 == url and _info(url)["weight_version"] == "0"
        v2 = _tensors(weights[2])
        report = publish_tensors([proxy.url], iter(v2.items()), 2, sender=sender, bucket_mb=BUCKET_MB)
        assert report.ok and report.loaded == [url] and report.groups_made == 1 and sender.groups_made == 2
        info = _info(url)
        assert info["weight_version"] == "2" and info["weight_update_groups_joined"] == 1
        _assert_exact(url, v2, big_rows=64)
        st = _status(proxy.url)
        assert st["out_of_rotation"] == {} and st["version"] == 2
        code, versions = _chat_versions(proxy.url)
        assert code == 200 and set(versions) == {2}
    finally:
        sender.close()
        kill_tree(proxy)
        stop()


@pytest.mark.parametrize("mode", ["auto", "disk"])
def test_train_step_publishes_by_broadcast_where_the_engines_support_it(proxy_factory, model_dir, tmp_path, mode):
    from openai import OpenAI

    from trainer_bridge.config import TrainConfig
    from trainer_bridge.train import train

    proxy = proxy_factory(script=["Four.<|im_end|>", "Five.<|im_end|>"])
    for k, reward in enumerate((1.0, 0.0)):
        sid = f"wt-{mode}-{k}"
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x",
                        default_headers={"X-Session-Id": sid, "X-Group-Id": f"g-{mode}", "X-Group-Size": "2"})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"2+{k + 2}?"}])
        assert proxy.post(f"/v1/sessions/{sid}/reward", {"reward": reward}).status_code == 200
    engine = proxy.get("/admin/status").json()["engines"]["replicas"][0]["url"]
    before = _info(engine)

    out = tmp_path / "train"
    stats = train(TrainConfig(proxies=[proxy.url], model=model_dir, out=str(out), steps=1, batch_samples=2, min_samples=2,
                              lr=1e-2, pull_wait_s=5, pull_timeout_s=60, progress=False, weight_transfer=mode, bucket_mb=4.0))
    expected = "distributed" if mode == "auto" else "disk"  # the reference engine speaks SGLang's weight API
    assert len(stats) == 1 and stats[0]["weight_transfer"] == expected and stats[0]["publish_time_s"] > 0
    info = _info(engine)
    assert info["weight_version"] == "1"
    if expected == "distributed":
        assert info["model_path"] == before["model_path"] and info["tensor_updates"] > before["tensor_updates"]
    else:
        assert info["model_path"] == str(out / "step_1") and info["tensor_updates"] == before["tensor_updates"]
    _assert_exact(engine, _tensors(str(out / "step_1")), big_rows=64)  # the engine serves what the step saved
    assert _status(proxy.url)["version"] == 1


def test_two_fsdp2_ranks_publish_by_broadcast_from_rank_0(proxy_factory, model_dir, tmp_path):
    """``torchrun --nproc-per-node 2 -m trainer_bridge.train``: both ranks gather the FSDP2 shards
    (a collective), rank 0 alone broadcasts, and the engine serves exactly what the step saved."""
    import json

    from openai import OpenAI

    proxy = proxy_factory(script=["Four.<|im_end|>", "Five.<|im_end|>"])
    for k, reward in enumerate((1.0, 0.0)):
        sid = f"wt-fsdp-{k}"
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x",
                        default_headers={"X-Session-Id": sid, "X-Group-Id": "g-fsdp", "X-Group-Size": "2"})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"2+{k + 2}?"}])
        assert proxy.post(f"/v1/sessions/{sid}/reward", {"reward": reward}).status_code == 200
    engine = proxy.get("/admin/status").json()["engines"]["replicas"][0]["url"]
    before = _info(engine)
    out = tmp_path / "train"
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainer_bridge.train",
           "--proxy", proxy.url, "--model", model_dir, "--out", str(out), "--steps", "1", "--batch-samples", "2",
           "--min-samples", "2", "--lr", "1e-2", "--pull-wait-s", "5", "--pull-timeout-s", "60", "--no-progress",
           "--weight-transfer", "distributed", "--bucket-mb", "4"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[:3000] + proc.stderr[-3000:]
    stats = [json.loads(line) for line in (out / "stats.jsonl").read_text().splitlines()]
    assert len(stats) == 1 and stats[0]["weight_transfer"] == "distributed"
    info = _info(engine)
    assert info["weight_version"] == "1" and info["model_path"] == before["model_path"]  # never told a path
    assert info["tensor_updates"] > before["tensor_updates"]
    _assert_exact(engine, _tensors(str(out / "step_1")), big_rows=64)
    assert _status(proxy.url)["version"] == 1


LONG = (
    "The quick brown fox jumps over the lazy dog while the patient cat watches from the warm windowsill, "
    "counting birds that fly past the old oak tree in the garden behind the house; meanwhile the farmer "
    "walks to the barn, opens the heavy wooden door and feeds the horses."
)


def test_a_broadcast_landing_mid_turn_stamps_every_token_exactly(tmp_path, model_dir, weights):
    """A generation in flight when the weights move by broadcast: tokens before are v0, tokens
    after are v1, and the v0 tokens' proximal values are log pi_v1 from an independent forward
    pass over the published weights."""
    import threading

    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge.publish import publish_tensors

    proxy = start_proxy(tmp_path, model_dir, script=[LONG + "<|im_end|>"], delay_ms=40)
    try:
        sid = "xfer-mid-" + uuid.uuid4().hex[:8]
        seen: list[str] = []
        got = threading.Event()
        result: dict = {}

        def agent():
            try:
                with httpx.stream("POST", proxy.url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120,
                                  json={"model": "m", "messages": [{"role": "user", "content": "A story."}], "stream": True}) as r:
                    result["status"] = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: ") and '"content"' in line:
                            seen.append(line)
                            if len(seen) >= 12:
                                got.set()
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc
            finally:
                got.set()

        th = threading.Thread(target=agent)
        th.start()
        assert got.wait(60) and "error" not in result, result
        report = publish_tensors([proxy.url], iter(_tensors(weights[1]).items()), 1, bucket_mb=BUCKET_MB)
        assert report.ok
        th.join(120)
        assert result.get("status") == 200 and "error" not in result, result

        (t,) = httpx.get(proxy.url + f"/v1/sessions/{sid}", headers=admin_headers(), timeout=30).json()["turns"]
        versions, out, prompt = t["versions"], t["output_ids"], t["prompt_ids"]
        k = versions.index(1)
        assert 0 < k < len(out) - 5 and versions == [0] * k + [1] * (len(out) - k)
        model = AutoModelForCausalLM.from_pretrained(weights[1], dtype=torch.float64).eval()
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0], dim=-1)
        ref_v1 = [float(lp[i - 1, (prompt + out)[i]]) for i in range(len(prompt), len(prompt) + len(out))]
        assert t["proximal_versions"] == [1] * len(out)
        assert t["proximal_logprobs_t"][:k] == pytest.approx(ref_v1[:k], abs=1e-4)
        assert t["output_logprobs"][k:] == pytest.approx(ref_v1[k:], abs=1e-4)  # sampled by the broadcast weights
    finally:
        kill_tree(proxy)


def test_bad_weight_transfer_requests_get_openai_shaped_errors(fleet):
    url = fleet["urls"][0]
    cases = [
        ("/admin/weights/update", {"engine": "http://nowhere:1", "group_name": "g", "version": 1, "names": [], "dtypes": [], "shapes": []}, "engine"),
        ("/admin/weights/update", {"engine": fleet["a"], "group_name": "g", "version": 1, "names": ["x"], "dtypes": [], "shapes": []}, None),
        ("/admin/weights/init_group", {"engine": fleet["a"], "master_address": "127.0.0.1", "master_port": 1, "group_name": "g", "backend": "mpi"}, None),
        ("/admin/weights/ranks", {"engine": "http://nowhere:1"}, "engine"),
    ]
    for path, body, param in cases:
        r = httpx.post(url + path, json=body, headers=admin_headers(), timeout=30)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"]
        if param:
            assert err.get("param") == param
    st = _status(url)
    assert st["paused"] is False and fleet["a"] not in st["out_of_rotation"]  # nothing was touched


def test_a_trainer_that_hangs_up_takes_the_engines_join_with_it(fleet):
    """The trainer names an address the engine cannot reach, then gives up: the proxy cancels
    its call to the engine and the engine stops trying to reach the trainer (it would otherwise
    retry for its own rendezvous timeout, 600 s)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens there
    body = {"engine": fleet["a"], "master_address": "127.0.0.1", "master_port": port, "group_name": "unreachable",
            "backend": "gloo", "rank_offset": 1, "world_size": 2}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet["urls"][0] + "/admin/weights/init_group", json=body, headers=admin_headers(), timeout=1.5)
    deadline = time.monotonic() + 15
    while _info(fleet["a"])["weight_update_groups_joining"] and time.monotonic() < deadline:
        time.sleep(0.1)
    info = _info(fleet["a"])
    assert info["weight_update_groups_joining"] == 0 and "unreachable" not in info["weight_update_groups"]
    assert _chat_versions(fleet["urls"][0])[0] == 200  # the engine serves as before
