"""The start-up noise filters (diffrl/runtime/quiet.py): the known lines go, others stay."""

from __future__ import annotations

import logging

import diffrl  # noqa: F401  (installs the filters)
from diffrl.runtime.quiet import NOISE, quiet_known_noise


def test_the_known_lines_are_dropped_and_other_lines_of_those_loggers_pass(caplog):
    quiet_known_noise()  # a second install adds no second filter
    for name, text in NOISE.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == len({id(f) for f in logger.filters})
        with caplog.at_level(logging.WARNING, logger=name):
            caplog.clear()
            logger.warning("<enum 'X'> %s. Calling register_constant() ...", text)
            logger.warning("a different warning")
        assert [r.getMessage() for r in caplog.records] == ["a different warning"], name
