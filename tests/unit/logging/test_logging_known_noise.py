"""The known-noise filters drop exactly the known messages: other warnings of the same modules, and other records of
the same loggers, still show."""

from __future__ import annotations

import logging
import warnings

from mrl.logging.known_noise import LOG_RECORDS, WARNINGS, silence_known_noise


def _shown(message: str, module: str) -> bool:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_known_noise()
        warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    return bool(caught)


def test_known_warnings_are_dropped_and_others_of_the_same_module_shown():
    assert not _shown("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                      "megatron.core.optimizer")
    assert not _shown("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
    assert _shown("Transformer Engine and Apex are not installed.", "somewhere.else")  # the module matters
    assert _shown("gradient overflow, skipping the step", "megatron.core.optimizer")  # a real warning shows


def test_known_log_records_are_dropped_and_others_of_the_same_logger_shown(caplog):
    silence_known_noise()
    silence_known_noise()  # idempotent: one filter per logger
    logger = logging.getLogger(LOG_RECORDS[0].source)
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
        logger.warning("kernel registration failed")
    assert [r.getMessage() for r in caplog.records] == ["kernel registration failed"]


def test_every_entry_says_why_it_is_harmless():
    assert all(len(entry.why) > 20 for entry in (*WARNINGS, *LOG_RECORDS))
