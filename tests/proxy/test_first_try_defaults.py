"""What ``splice serve`` gives the embedded engine: the bundled untrained model answers with the
first-try script unless told to sample (then with a small output budget); a model of your own,
or a script of your own, is served as given; ``--quiet`` reaches the settings."""

from __future__ import annotations

import argparse
import os

from engines.reference.first_try import FIRST_TRY_SCRIPT, SAMPLED_MAX_OUTPUT_TOKENS
from proxy.cli import _bundled_defaults, _serve_parser, settings_from_args


def _settings(*flags: str):
    ap = argparse.ArgumentParser()
    _serve_parser(ap.add_subparsers(dest="command"))
    return settings_from_args(ap.parse_args(["serve", *flags]))


def test_bundled_model_answers_with_the_first_try_script():
    settings, script = _bundled_defaults(_settings())
    assert script == FIRST_TRY_SCRIPT and script[0].endswith("<|im_end|>")  # every reply ends its turn
    assert settings.reference_script == "first-try"
    assert settings.max_output_tokens is None  # the script ends each turn; nothing to cap


def test_sampling_the_bundled_model_caps_its_output():
    settings, script = _bundled_defaults(_settings("--reference-script", "none"))
    assert script is None
    assert settings.max_output_tokens == SAMPLED_MAX_OUTPUT_TOKENS
    settings, _ = _bundled_defaults(_settings("--reference-script", "none", "--max-output-tokens", "9"))
    assert settings.max_output_tokens == 9  # an explicit budget wins


def test_own_model_or_script_is_served_as_given(tmp_path):
    settings, script = _bundled_defaults(_settings("--reference-model", str(tmp_path)))
    assert script is None and settings.max_output_tokens is None  # samples, whatever fits
    settings, script = _bundled_defaults(_settings("--reference-script", "replies.json"))
    assert script == os.path.abspath("replies.json") and settings.max_output_tokens is None
    _, script = _bundled_defaults(_settings("--reference-model", str(tmp_path), "--reference-script", "first-try"))
    assert script == FIRST_TRY_SCRIPT  # the first-try reply by name, for any model


def test_quiet_flag_and_environment(monkeypatch):
    assert _settings().quiet is False
    assert _settings("--quiet").quiet is True
    monkeypatch.setenv("SPLICE_QUIET", "1")
    assert _settings().quiet is True
