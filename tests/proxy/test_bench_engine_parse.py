"""``python -m proxy.bench.engine_parse`` runs end to end (small sizes), also timing another
checkout's parser in a child process (here: this one); no timing asserted."""

from __future__ import annotations

from pathlib import Path

from proxy.bench import engine_parse

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_parse_small(capsys):
    assert engine_parse.main(["--rounds", "1", "--cases", "output:40", "input:500", "--src", str(ROOT)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == "entries" and "this checkout" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert [r[:2] for r in rows] == [["40", "output"], ["500", "input"]]
    assert all(float(x) > 0 for r in rows for x in r[2:])


def test_built_replies_parse_to_what_they_hold():
    import orjson

    from engines.sglang import parse_response

    body, prompt, start = engine_parse._body("input", 300)
    reply = orjson.loads(body)
    seg = parse_response(reply, prompt, start, "bench")
    assert seg.input_logprobs[0] is None and len(seg.input_logprobs) == 300
    assert seg.output_ids == [e[1] for e in reply["meta_info"]["output_token_logprobs"]]
