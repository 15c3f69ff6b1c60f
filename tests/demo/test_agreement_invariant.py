"""The demo's agreement invariant and its console figures."""

from __future__ import annotations

from proxy.demo.invariants import agreement_problems
from proxy.demo.loop import engine_warnings
from proxy.demo.report import agreement_line


def test_agreement_within_bound_is_no_problem():
    stats = [{"step": 1, "token_mult_prob_error": 1.00001, "agreement_abs_gap_max": 3e-5},
             {"step": 2, "token_mult_prob_error": None}]
    assert agreement_problems(stats) == []
    assert "max 1.00001 over 1/2 steps" in agreement_line(stats)


def test_a_step_past_the_bound_and_an_unmeasured_run_are_problems():
    bad = agreement_problems([{"step": 1, "token_mult_prob_error": 1.0}, {"step": 4, "token_mult_prob_error": 1.6}])
    assert len(bad) == 1 and "step 4" in bad[0] and "1.6" in bad[0]
    assert agreement_problems([{"step": 1}]) and "not measured" in agreement_line([{"step": 1}])


def test_proxy_warnings_reach_the_console(tmp_path):
    log = tmp_path / "proxy.log"
    log.write_text("INFO ready\n2026-11-26 WARNING engines.pool: http://e: the model ties its LM head ...\n")
    assert engine_warnings(log) == ["engines.pool: http://e: the model ties its LM head ..."]
    assert engine_warnings(tmp_path / "missing.log") == []
