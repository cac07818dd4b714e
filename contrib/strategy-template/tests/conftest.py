"""Deterministic Hypothesis runs: the same examples on every machine and in CI."""

from hypothesis import settings

settings.register_profile("template", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("template")
