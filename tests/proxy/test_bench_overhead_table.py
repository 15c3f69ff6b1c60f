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
