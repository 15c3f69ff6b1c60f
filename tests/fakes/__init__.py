"""Test doubles shared across the suite (one set: runner.py for the front ends, engines.py for engine wire formats)."""
