import logging

from semshare_vllm.logs import warn_once


def test_a_fault_kind_is_warned_once_then_logged_at_debug(caplog):
    logger = logging.getLogger("vllm.semshare.test_logs")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for i in range(3):
            warn_once(logger, "load", "loading donor %d failed", i)
        warn_once(logger, "recompute", "recompute failed")
    levels = [(r.levelno, r.getMessage().split(" (")[0]) for r in caplog.records]
    assert levels == [
        (logging.WARNING, "loading donor 0 failed"),
        (logging.DEBUG, "loading donor 1 failed"),
        (logging.DEBUG, "loading donor 2 failed"),
        (logging.WARNING, "recompute failed"),
    ]


def test_a_guarded_callback_counts_logs_once_and_falls_back(caplog):
    from semshare_vllm.core.counters import StatsRecorder
    from semshare_vllm.logs import guarded

    class Half:
        logger = logging.getLogger("vllm.semshare.test_guard")

        def __init__(self):
            self.stats, self.cleaned = StatsRecorder(), []

        @guarded("lookup", (0, False), on_fault="_clean")
        def match(self, n):
            raise RuntimeError(f"boom {n}")

        def _clean(self, n):
            self.cleaned.append(n)

    half = Half()
    with caplog.at_level(logging.DEBUG, logger=Half.logger.name):
        assert [half.match(i) for i in range(3)] == [(0, False)] * 3
    assert half.stats.totals["fallbacks"] == 3 and half.cleaned == [0, 1, 2]
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and r.name == Half.logger.name
    ]
    assert len(warnings) == 1 and "lookup failed" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None
