import logging

from semshare_vllm.logs import warn_once


def test_a_fault_kind_is_warned_once_then_logged_at_debug(caplog):
    logger = logging.getLogger("vllm.semshare.test_logs")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for i in range(3):
            warn_once(logger, "load", "loading donor %d failed", i)
        warn_once(logger, "recompute", "recompute failed")
    levels = [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels == [(logging.WARNING, "loading donor 0 failed"),
                      (logging.DEBUG, "loading donor 1 failed"),
                      (logging.DEBUG, "loading donor 2 failed"),
                      (logging.WARNING, "recompute failed")]
