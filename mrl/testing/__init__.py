"""Helpers for the tests only (production code never imports them): tiny models, multi-rank runs, CLI runs."""
