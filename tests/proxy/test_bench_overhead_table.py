"""``splice bench overhead`` sets Splice beside LiteLLM as ratios of the same run (absolute
milliseconds depend on the machine; the ratios are what compare across machines)."""

from __future__ import annotations

from proxy.bench.overhead import _print_against_litellm
from proxy.bench.tables import format_table


def _phase(turns, turns_per_s, p50, cpu=None):
    return {"turns": turns, "turns_per_s": turns_per_s, "p50_ms": p50, "cpu_ms_per_turn": cpu}


def test_ratios_are_splice_over_litellm_with_added_latency_net_of_the_engine(capsys):
    runs = [
        {"concurrency": 1, "direct_chat": _phase(300, 4000, 0.25), "splice": _phase(300, 200, 5.25, 4.4),
         "litellm": _phase(300, 40, 25.25, 29.0)},
        {"concurrency": 64, "direct_chat": _phase(640, 8000, 6.0), "splice": _phase(640, 300, 206.0, 3.5),
         "litellm": None},
    ]  # fmt: skip
    _print_against_litellm(runs, format_table)
    out = capsys.readouterr().out
    row = [line.split() for line in out.splitlines() if line.startswith("1 ")]
    assert row == [["1", f"{4.4 / 29.0:.2f}", f"{5.0 / 25.0:.2f}", f"{200 / 40:.2f}"]]
    assert not any(line.startswith("64 ") for line in out.splitlines())  # no LiteLLM at C=64: no row


def test_nothing_is_printed_without_litellm(capsys):
    runs = [{"concurrency": 1, "direct_chat": _phase(300, 4000, 0.25), "splice": _phase(300, 200, 5.0, 4.0)}]
    _print_against_litellm(runs, format_table)
    assert capsys.readouterr().out == ""


def test_cpu_seconds_read_a_process_tree_to_the_millisecond():
    """The reference: the process's own CPU clock (``time.process_time``), printed when it is done
    burning about 0.3 s of CPU in two threads."""
    import subprocess
    import sys

    from proxy.bench.overhead import _cpu_seconds

    code = ("import threading, time\n"
            "def burn():\n    t = time.thread_time()\n    while time.thread_time() - t < 0.15: pass\n"
            "ts = [threading.Thread(target=burn) for _ in range(2)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
            "print(time.process_time(), flush=True)\ninput()\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        own = float(proc.stdout.readline())
        measured = _cpu_seconds(proc.pid)
    finally:
        proc.communicate("\n")
    assert own > 0.25
    assert abs(measured - own) < 0.005 or abs(measured - own) / own < 0.02


def test_alternating_blocks_charge_each_group_its_own_turns_and_swap_the_order():
    """``alternate`` (the growth and history phases): a fake proxy whose CPU clock advances by a
    known cost per turn of each group; each group must come out at exactly its cost."""
    from proxy.bench.growth import alternate

    clock = {"s": 0.0, "block_start": False}
    order: list[str] = []

    class Chat:
        def turn(self, msgs, t):
            clock["s"] += {"short": 0.001, "long": 0.003}[msgs[0]]
            if clock["block_start"]:  # the first turn after a clock reading opens a block
                order.append(msgs[0])
                clock["block_start"] = False
            msgs.append(msgs[0])

    def cpu_seconds(pid):
        clock["block_start"] = True
        return clock["s"]

    groups = {"short": [["short"], ["short"]], "long": [["long"]]}
    cpu, n = alternate(Chat(), 0, cpu_seconds, groups, rounds=3)
    assert n == {"short": 24, "long": 12}
    assert abs(cpu["short"] / n["short"] - 0.001) < 1e-12 and abs(cpu["long"] / n["long"] - 0.003) < 1e-12
    assert order == ["short", "long", "long", "short", "short", "long"]


def test_the_reply_thinks_longer_by_about_the_tokens_asked():
    from tokenization import load_tokenizer, qwen3_tokenizer_dir

    from proxy.bench.stack import REPLY_TEXT, reply_ids

    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    short = reply_ids(tok)
    assert tok.decode(short) == REPLY_TEXT
    for n in (100, 900):
        ids = reply_ids(tok, n)
        assert len(short) + n <= len(ids) <= len(short) + n + 12  # overshoots by at most one sentence
        text = tok.decode(ids)  # still one thinking block, then the one tool call
        think, _, call = text.partition("</think>")
        assert think.startswith("<think>\nI should call f.") and len(think) > 3 * n
        assert call == REPLY_TEXT.partition("</think>")[2]
