"""``splice bench overhead --profile`` reads py-spy's collapsed stacks: waiting threads are not
counted as work, and a frame's inclusive share counts each sample once."""

from proxy.bench.profile import by_part, summarize, top_frames

STACKS = """\
MainThread;<module> (<string>:1);run (asyncio/runners.py:118) 50
MainThread;<module> (<string>:1);run (asyncio/runners.py:118);run (proxy/session/runner.py:187);add (proxy/store/turns.py:142) 30
MainThread;<module> (<string>:1);run (asyncio/runners.py:118);run (proxy/session/runner.py:161);plan (proxy/session/planner.py:156) 10
Thread-1;_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 40
Thread-1;_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);run (concurrent/futures/thread.py:58);set_drift (proxy/store/turns.py:193) 10
"""


def test_idle_samples_are_dropped_and_shares_add_up(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(STACKS)
    total, incl, own = summarize(str(path))
    assert total == 50  # the loop inside uvloop and the idle pool thread are waiting, not working
    assert incl["runner.py:run"] == 40 and own["turns.py:add"] == 30 and own["turns.py:set_drift"] == 10
    text = top_frames(str(path))
    assert "50 busy samples" in text and "turns.py:add" in text


def test_a_sample_belongs_to_its_innermost_known_part(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(STACKS + "MainThread;<module> (<string>:1);run (proxy/session/runner.py:258);generate (engines/sglang.py:232);"
                    "dumps (orjson/__init__.py:1) 7\n")  # fmt: skip
    total, parts = by_part(str(path))
    assert total == 57
    assert parts == {"store": 40, "session logic (planner, runner, drift, R2)": 10, "engine client": 7}
    assert "part of the proxy" in top_frames(str(path))


def test_a_garbled_frame_does_not_stop_the_report(tmp_path):
    """py-spy can read a thread's frame while it is being rewritten: a line of bytes that are not
    UTF-8 (seen in a real recording). It counts as an unknown frame; the report still comes."""
    path = tmp_path / "p.txt"
    path.write_bytes(STACKS.encode() + b"MainThread;\xff\xbf\xbf\xbf\xc3\xa4 (\xef\xbf\xbd:17);decode (x.py:1) 3\n")
    total, _, _ = summarize(str(path))
    assert total == 53
    assert "53 busy samples" in top_frames(str(path))


def test_py_spy_is_asked_for_gil_samples_only_when_told(tmp_path, monkeypatch):
    import os
    import sys

    from proxy.bench.profile import start_profile, stop_profile

    log = tmp_path / "args.txt"
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!{sys.executable}\nimport sys, time\nopen({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    "time.sleep(0.05)\n")  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setenv("PY_SPY", str(fake))
    for gil in (False, True):
        proc = start_profile(os.getpid(), str(tmp_path / "out.txt"), gil=gil)
        proc.wait(30)
        stop_profile(proc)
    plain, with_gil = log.read_text().splitlines()
    assert "--gil" not in plain.split() and "--gil" in with_gil.split()
    assert f"--pid {os.getpid()}" in with_gil


def test_a_py_spy_that_cannot_run_is_a_clear_error(tmp_path, monkeypatch):
    import pytest

    from proxy.bench.profile import start_profile

    fake = tmp_path / "py-spy"
    fake.write_text("")
    fake.chmod(0o644)
    monkeypatch.setenv("PY_SPY", str(fake))
    with pytest.raises(SystemExit, match="not executable"):
        start_profile(1, str(tmp_path / "out.txt"))
