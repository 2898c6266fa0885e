"""A step's device time without waiting for the device, and what rank 0 logs of it (issue #39).

``StepClock`` times a step's forward pass and sampling (CUDA events, read once the step's results are on the
host: launched_step.py's ``ResultCopy``, the one synchronisation a decode step makes), and the device's idle
time before the step; ``DeviceTimeline`` adds those up and logs them per window, with the host's side of
each step, which the idle time is made of: building and launching it, waiting for the step before, and the
turnaround from sending a result to the next command's arrival (the bus and the scheduler).
"""

from __future__ import annotations

import time

import structlog
import torch

from llmbus.bus.gc_pauses import GcPauses

# Rank 0 on CUDA logs the device's busy and idle time between steps ("device timeline") once per this many
# seconds in which steps ran.
TIMELINE_WINDOW_S = 5.0
# A longer wait between steps is the server having nothing to run, not the step loop's turnaround: not counted.
IDLE_GAP_CAP_S = 0.05
# Clocks' CUDA events whose readings are done, to record again: making three a step was ~34 us of rank 0's host
# time a step with their records (run 14's py-spy on an H200's host).
_SPARE_EVENTS: list[list[torch.cuda.Event]] = []


class StepClock:
    """A step's forward and sampling times without waiting for the device: host time on the CPU; on CUDA,
    events recorded in the stream and read once the step's results have come back to the host (the one
    synchronisation a decode step makes), so the times are the device's. Given the previous step's clock,
    also how long the device sat idle between that step's last op and this step's first (``idle_before``):
    the start event runs as soon as the stream reaches it, at once where the device had nothing queued.

    A clock's events are read twice, by its own ``times`` and by the next clock's (its end event), in either
    order (a step that samples nothing is timed at its launch, before the step before it is read); once both
    have read them, a later clock records them again."""

    def __init__(self, device: torch.device, previous: "StepClock | None" = None):
        self.started = time.perf_counter()
        self.events = self.previous = None
        self._readers_left = 2
        self._times: tuple[float, float] | None = None
        if device.type == "cuda":
            self.events = (_SPARE_EVENTS.pop() if _SPARE_EVENTS
                           else [torch.cuda.Event(enable_timing=True) for _ in range(3)])
            self.previous = previous if previous is not None and previous.events else None
        self.idle_before = 0.0
        if self.events:
            self.events[0].record()

    def forward_done(self) -> None:
        if self.events:
            self.events[1].record()
        else:
            self.forwarded = time.perf_counter()

    def sampling_done(self) -> None:
        """Recorded before the results are copied to the host: the copy waits for it."""
        if self.events:
            self.events[2].record()
        else:
            self.sampled = time.perf_counter()

    def times(self, wait: bool = False) -> tuple[float, float]:
        """(forward, sampling) seconds, once the results are on the host (``wait``: a step that returns none
        waits for the device here)."""
        if self.events:
            if self._times is None:
                start, forwarded, sampled = self.events
                if wait:
                    sampled.synchronize()
                if self.previous is not None:
                    self.idle_before = self.previous.events[2].elapsed_time(start) / 1e3
                    self.previous._read()
                    self.previous = None
                self._times = start.elapsed_time(forwarded) / 1e3, forwarded.elapsed_time(sampled) / 1e3
                self._read()
            return self._times
        return self.forwarded - self.started, self.sampled - self.forwarded

    def _read(self) -> None:
        """One of the two readings of this clock's events is done; after both, they are spare."""
        self._readers_left -= 1
        if self._readers_left == 0:
            _SPARE_EVENTS.append(self.events)


class DeviceTimeline:
    """Rank 0 on CUDA: the device's time in steps and idle between them, logged per window (issue #39's "GPU
    idle between decode steps": the scheduler's turnaround, which overlap scheduling hides)."""

    def __init__(self):
        self.log = structlog.get_logger("llmbus.workers")
        self.gc: GcPauses | None = None  # counting from the first step on (warmup's collections are not serving's)
        self._reset()

    def _reset(self) -> None:
        self.window_started = time.monotonic()
        self.steps, self.rows, self.busy_s, self.idle_s = 0, 0, 0.0, 0.0
        self.eager_steps, self.eager_idle_s = 0, 0.0
        self.host_steps, self.launch_s, self.wait_s, self.apply_s = 0, 0.0, 0.0, 0.0
        self.eager_host_steps, self.eager_launch_s = 0, 0.0
        self.turnarounds, self.turnaround_s = 0, 0.0

    def add_host(self, launch_s: float, wait_s: float, turnaround_s: float, apply_s: float = 0.0,
                 replayed: bool = True) -> None:
        """The worker's side of a step: receiving its command to its launch returning (``apply_s`` of it
        before the runner's launch began: the command's new requests and rows), the wait for the step before's
        results, and the time from sending the last result to this command's arrival; ``replayed``: the step
        replayed a decode graph (an eager step's launch is logged apart too)."""
        self.host_steps += 1
        self.launch_s += launch_s
        self.wait_s += wait_s
        self.apply_s += apply_s
        if not replayed:
            self.eager_host_steps += 1
            self.eager_launch_s += launch_s
        if turnaround_s <= IDLE_GAP_CAP_S:
            self.turnarounds += 1
            self.turnaround_s += turnaround_s

    def add(self, clock: StepClock, busy_s: float, rows: int, replayed: bool = False) -> None:
        """A step's device time; ``replayed``: a CUDA graph's (the idle before a step launched eagerly, a
        prompt chunk's say, is counted apart too: its launch is several times a replay's)."""
        if self.gc is None:
            self.gc = GcPauses().start()
        self.steps += 1
        self.rows += rows
        self.busy_s += busy_s
        self.eager_steps += not replayed
        if clock.idle_before <= IDLE_GAP_CAP_S:
            self.idle_s += clock.idle_before
            if not replayed:
                self.eager_idle_s += clock.idle_before
        if time.monotonic() - self.window_started >= TIMELINE_WINDOW_S:
            total = self.busy_s + self.idle_s
            host = max(self.host_steps, 1)
            self.log.info("device timeline", steps=self.steps, mean_rows=round(self.rows / self.steps, 1),
                          busy_ms=round(self.busy_s * 1e3, 1), idle_ms=round(self.idle_s * 1e3, 1),
                          idle_share=round(self.idle_s / total, 4) if total else 0.0,
                          eager_steps=self.eager_steps, eager_idle_ms=round(self.eager_idle_s * 1e3, 1),
                          step_busy_ms=round(self.busy_s * 1e3 / self.steps, 3),
                          host_launch_ms=round(self.launch_s * 1e3 / host, 3),
                          host_apply_ms=round(self.apply_s * 1e3 / host, 3),
                          eager_launch_ms=round(self.eager_launch_s * 1e3 / max(self.eager_host_steps, 1), 3),
                          host_wait_ms=round(self.wait_s * 1e3 / host, 3),
                          turnaround_ms=round(self.turnaround_s * 1e3 / max(self.turnarounds, 1), 3),
                          **self.gc.take())
            self._reset()
