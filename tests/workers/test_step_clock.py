"""Rank 0's device timeline: the device's idle time between steps, and the host's side of each step."""

import gc

import pytest
import structlog
import torch

from llmbus.workers import step_clock
from llmbus.workers.step_clock import DeviceTimeline, StepClock


@pytest.fixture(autouse=True)
def own_gc_callbacks():
    """A timeline counts collections through gc.callbacks from its first step: each test's goes with it."""
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before


def test_a_window_says_what_the_host_spent_per_step(monkeypatch):
    monkeypatch.setattr(step_clock, "TIMELINE_WINDOW_S", 0.0)  # every step closes a window
    timeline = DeviceTimeline()
    timeline.add_host(launch_s=0.0004, wait_s=0.001, turnaround_s=0.0006, apply_s=0.0001, replayed=False)
    timeline.add_host(launch_s=0.0002, wait_s=0.003, turnaround_s=1.0, apply_s=0.0003)  # nothing to run
    clock = StepClock(torch.device("cpu"))
    with structlog.testing.capture_logs() as logs:
        timeline.add(clock, busy_s=0.002, rows=64)
    (window,) = [entry for entry in logs if entry["event"] == "device timeline"]
    assert window["steps"] == 1 and window["step_busy_ms"] == 2.0
    assert window["host_launch_ms"] == 0.3 and window["host_wait_ms"] == 2.0
    assert window["turnaround_ms"] == 0.6  # the idle gap past IDLE_GAP_CAP_S is not a turnaround
    assert window["host_apply_ms"] == 0.2 and window["eager_launch_ms"] == 0.4
    assert window["eager_steps"] == 1 and window["eager_idle_ms"] == 0.0
    # the garbage collector's pauses, counted from the first step on
    assert {"gc_collections", "gc_full", "gc_ms", "gc_longest_ms"} <= set(window)
    gc.collect()
    with structlog.testing.capture_logs() as logs:
        timeline.add(StepClock(torch.device("cpu")), busy_s=0.002, rows=64)
    (window,) = [entry for entry in logs if entry["event"] == "device timeline"]
    assert window["gc_collections"] >= 1 and window["gc_full"] >= 1 and window["gc_longest_ms"] >= 0


def test_the_idle_before_eager_steps_is_counted_apart(monkeypatch):
    """Which steps the device waited for: a replayed step's launch is a few copies and the graph, an eager
    step's (a prompt chunk) several hundred launches."""
    monkeypatch.setattr(step_clock, "TIMELINE_WINDOW_S", 3600.0)
    timeline = DeviceTimeline()
    for replayed, idle in ((True, 0.0001), (False, 0.0005), (True, 0.0), (False, 0.0002)):
        clock = StepClock(torch.device("cpu"))
        clock.idle_before = idle
        timeline.add(clock, busy_s=0.002, rows=64, replayed=replayed)
    monkeypatch.setattr(step_clock, "TIMELINE_WINDOW_S", 0.0)
    with structlog.testing.capture_logs() as logs:
        timeline.add(StepClock(torch.device("cpu")), busy_s=0.002, rows=64, replayed=True)
    (window,) = [entry for entry in logs if entry["event"] == "device timeline"]
    assert window["steps"] == 5 and window["eager_steps"] == 2
    assert window["idle_ms"] == 0.8 and window["eager_idle_ms"] == 0.7


class _StandInEvent:
    """A CUDA timing event on the CPU: ``record`` stamps it (the stand-in stream has run everything before)."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False):
        self.at = None

    def record(self):
        _StandInEvent.clock += 1.0
        self.at = _StandInEvent.clock

    def synchronize(self):
        pass

    def elapsed_time(self, end) -> float:
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def _clock(previous=None):
    clock = StepClock(torch.device("cuda"), previous)
    clock.forward_done()
    clock.sampling_done()
    return clock


def test_a_clocks_events_are_recorded_again_only_once_it_and_the_next_clock_have_read_them(monkeypatch):
    """Three events a step, made once: a clock's go back once its own times and the next clock's (which reads
    its end) are taken, in either order (a step that samples nothing is timed at its launch, before the step
    before it is read), and never twice."""
    monkeypatch.setattr(torch.cuda, "Event", _StandInEvent)
    monkeypatch.setattr(step_clock, "_SPARE_EVENTS", [])
    first = _clock()
    second = _clock(first)
    assert second.times(wait=True) == (1.0, 1.0)  # read at its launch: the first is not read yet
    assert step_clock._SPARE_EVENTS == [] and second.idle_before == 1.0  # the first's end to the second's start
    assert first.times() == (1.0, 1.0) and first.times() == (1.0, 1.0)  # the second call reads nothing
    assert step_clock._SPARE_EVENTS == [first.events]
    third = _clock(second)
    assert third.events is first.events and step_clock._SPARE_EVENTS == []  # recorded again
    third.times()
    assert step_clock._SPARE_EVENTS == [second.events]  # the second's, read by itself and by the third
    fourth = _clock(third)
    assert fourth.events is second.events
    assert third.events is not fourth.events  # the third's still await the fourth's reading
