"""``core.stall_guard.StallGuard``: what a call that timed out returns late (review of e647fe0).
A late result answers its own key's next call, whatever other keys are asked in between (inside
the retry window or after it), and only while it is a result (not "not there", not an error)
and recent; a reset lets it go."""

import gc
import threading
import weakref

import pytest
import torch
from support.clock import SteppedClock

from semshare_vllm.core import stall_guard
from semshare_vllm.core.stall_guard import Stalled, StallGuard


def timed_out(guard, key, value):
    """A call of ``key`` that times out, then returns ``value`` (or raises it) late."""
    gate = threading.Event()

    def slow():
        gate.wait(5)
        if isinstance(value, Exception):
            raise value
        return value

    with pytest.raises(Stalled, match="did not return within"):
        guard.call(key, slow)
    gate.set()
    guard.running().join(5)
    assert guard.running() is None


def test_a_late_result_outlives_calls_of_other_keys():
    """Before: a load of another donor in between threw A's late result away, so A was read,
    and stalled, again: "read once" did not hold once loads interleave."""
    g = StallGuard("reading", timeout_s=0.05, retry_after_s=0.0)
    timed_out(g, "A", "A-late")
    assert g.call("B", lambda: "B") == "B"
    calls = []
    assert g.call("A", lambda: calls.append(1) or "A-again") == "A-late" and calls == []
    assert g.call("A", lambda: "A-again") == "A-again"  # it answers once


def test_a_late_result_outlives_a_refused_call_of_another_key():
    g = StallGuard("reading", timeout_s=0.05, retry_after_s=60.0)
    timed_out(g, "A", "A-late")
    with pytest.raises(Stalled, match="stalled less than"):
        g.call("B", lambda: "B")  # the window is on
    assert g.call("A", lambda: "A-again") == "A-late"  # before: refused as well


@pytest.mark.parametrize("late", [None, OSError("the mount went away")])
def test_not_there_or_an_error_is_never_kept(late):
    """Before: "no file" read late (the donor's write still queued behind the slow disk)
    answered the next load of the donor however much later, after the file had landed: the
    donor was taken as gone and its file deleted."""
    g = StallGuard("reading", timeout_s=0.05, retry_after_s=0.0)
    timed_out(g, "A", late)
    assert g.call("A", lambda: "read now") == "read now"


def test_a_late_result_is_kept_a_while_only_and_a_reset_lets_it_go():
    """Before: kept until the next call of any key, which after a reset (the host store reads
    nothing back any more) never comes: a whole donor's pages held for the worker's life."""
    clock = SteppedClock()
    g = StallGuard("reading", timeout_s=0.05, retry_after_s=0.0, clock=clock)
    timed_out(g, "A", torch.zeros(4))
    clock.now += stall_guard.LATE_KEPT_S + 1
    assert g.call("A", lambda: "read now") == "read now"
    timed_out(g, "A", torch.zeros(4))
    g.drop_late()
    assert g._late is None
    assert g.call("A", lambda: "read now") == "read now"


@pytest.mark.parametrize("how", ["drop_late", "taken"])
def test_a_late_result_let_go_is_freed_at_once(how):
    """Second review: the future kept its done-callback, which held the late result's record,
    which held the future: let go by a reset or taken by its key's call, a donor's pages stayed
    until the garbage collector's next full pass."""
    gc.collect()
    gc.disable()
    try:
        g = StallGuard("reading", timeout_s=0.05, retry_after_s=0.0)
        pages = torch.zeros(1 << 20)
        ref = weakref.ref(pages)
        timed_out(g, "A", pages)
        del pages
        if how == "drop_late":
            g.drop_late()
        else:
            assert g.call("A", lambda: None) is ref()
        assert ref() is None
    finally:
        gc.enable()
        g.close()


def test_calls_share_one_thread_until_one_stalls():
    g = StallGuard("reading", timeout_s=0.05, retry_after_s=0.0)
    first = g.call("A", threading.current_thread)
    assert g.call("B", threading.current_thread) is first
    timed_out(g, "C", "late")
    assert not first.is_alive()  # the stuck call returned, its thread ended
    assert g.call("D", threading.current_thread) is not first
    g.close()
