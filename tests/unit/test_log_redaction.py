"""Tokens are masked in every log record, once, whichever of its filters a record meets first."""
import io
import logging

import pytest

from hai.api import guards


@pytest.fixture
def logger():
    log = logging.getLogger("hai.test_redaction")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    flt = guards.RedactTokens()
    log.addFilter(flt)          # as install_redaction does: on the logger and on its handler
    handler.addFilter(flt)
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    yield log, stream
    log.removeHandler(handler)
    log.removeFilter(flt)


def test_tokens_in_the_message_and_its_arguments_are_masked(logger):
    log, stream = logger
    log.info('%s - "%s %s" %d', "10.0.0.1:5000", "GET", "/api/v1/jobs?access_token=hai_abcdefgh12345678", 401)
    log.info("agent haiagent_ZZZZZZZZZZ called with %(t)s", {"t": "hai_0123456789abcdef"})
    out = stream.getvalue()
    assert "access_token=hai_***" in out and "haiagent_***" in out and out.count("hai_***") == 2
    for secret in ("abcdefgh12345678", "ZZZZZZZZZZ", "0123456789abcdef"):
        assert secret not in out
    assert '"GET /api/v1/jobs?access_token=hai_***" 401' in out  # the rest of the line unchanged


def test_a_record_meeting_the_filter_at_its_logger_and_its_handler_is_masked_once(logger, monkeypatch):
    log, stream = logger
    calls = []
    real = guards._mask

    def counting(value):
        calls.append(value)
        return real(value)

    monkeypatch.setattr(guards, "_mask", counting)
    log.info("%s %s", "GET", "/api/v1/jobs?access_token=hai_abcdefgh12345678")
    assert len(calls) == 3  # the message and its two arguments, at the logger's filter only
    assert stream.getvalue().strip() == "GET /api/v1/jobs?access_token=hai_***"


def test_strings_without_a_token_pass_unchanged():
    for text in ("GET /api/v1/jobs 200", "chai_latte_is_not_a_token", "HAI_ABCDEFGHIJ"):
        assert guards._mask(text) == text
    assert guards._mask(42) == 42
