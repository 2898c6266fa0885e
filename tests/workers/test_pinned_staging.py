"""Pinned staging (``workers/pinned_staging.py``), on the CPU with stand-ins for CUDA's streams and events:
no copy's memory is handed out again before the event after that copy has passed, and no result buffer
before the host has read it."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmbus.workers.pinned_staging import ALIGN, ResultPool, UploadRing

SEGMENT = 1024


class FakeEvent:
    def __init__(self, hooks, stream, regions):
        self.hooks, self.stream, self.regions = hooks, stream, regions

    def synchronize(self):
        self.hooks.synchronized.append(self)
        for region in self.regions:
            self.hooks.live.discard(region)


class FakeHooks:
    """CUDA as the ring sees it: the stream copies are queued on, events; and which staged regions a copy
    may still be reading (``live``: handed out, and no event after them has been waited for)."""

    def __init__(self):
        self.ring = None
        self.current_stream = "s0"
        self.capturing_now = False
        self.live: set[tuple[int, int]] = set()
        self.unfenced: dict[int, list] = {}  # segment -> its (region, stream) not yet fenced
        self.events: list[FakeEvent] = []
        self.synchronized: list[FakeEvent] = []

    def pinned(self, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)

    def stream(self):
        return self.current_stream

    def capturing(self):
        return self.capturing_now

    def event_on(self, stream):
        """An event covers the copies queued on its own stream only: a region copied from on another stays live."""
        queued = self.unfenced.pop(self.ring.current, [])
        event = FakeEvent(self, stream, [region for region, on in queued if on == stream])
        self.events.append(event)
        return event


def ring_with_hooks(segments=4):
    hooks = FakeHooks()
    ring = UploadRing(hooks, segment_bytes=SEGMENT, segments=segments)
    hooks.ring = ring
    take = ring._take

    def checked_take(nbytes):
        staged = take(nbytes)
        start = staged.data_ptr() - ring.buffer.data_ptr()
        region = (start, start + nbytes)
        for other in hooks.live:
            assert region[1] <= other[0] or other[1] <= region[0] or nbytes == 0, (region, other)
        assert start % ALIGN == 0
        if nbytes:
            hooks.live.add(region)
            hooks.unfenced.setdefault(ring.current, []).append((region, hooks.current_stream))
        return staged

    ring._take = checked_take
    return ring, hooks


def test_an_upload_carries_its_values_and_dtype():
    ring, _ = ring_with_hooks()
    for values, dtype in (([3, 1, 4], torch.long), ([[0.5, 2.0], [1.5, -1.0]], torch.float32),
                          ([True, False], torch.bool), ([], torch.int32)):
        tensor = torch.tensor(values, dtype=dtype)
        sent = ring.upload(tensor, torch.device("cpu")).clone()  # on the CPU .to() keeps the staged view
        assert sent.dtype == dtype and torch.equal(sent, tensor)


def test_a_segment_is_reused_only_after_the_event_closing_it_is_waited_for():
    ring, hooks = ring_with_hooks(segments=2)
    for _ in range(3):  # fills segment 0 (3 x 512 > 1024: the third opens segment 1)
        ring.upload(torch.zeros(64, dtype=torch.long), torch.device("cpu"))
    assert ring.current == 1 and len(hooks.events) == 1 and not hooks.synchronized
    for _ in range(2):  # segment 1 full: back to segment 0, past its event
        ring.upload(torch.zeros(64, dtype=torch.long), torch.device("cpu"))
    assert ring.current == 0 and hooks.synchronized == [hooks.events[0]]


def test_a_copy_on_another_stream_closes_the_segment_on_the_stream_before():
    ring, hooks = ring_with_hooks()
    ring.upload(torch.zeros(4), torch.device("cpu"))
    hooks.current_stream = "s1"
    ring.upload(torch.zeros(4), torch.device("cpu"))
    assert ring.current == 1 and [e.stream for e in hooks.events] == ["s0"]


def test_too_large_or_under_capture_pins_its_own(monkeypatch):
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.numel()) or self)
    ring, hooks = ring_with_hooks()
    ring.upload(torch.zeros(SEGMENT // 8 + 1, dtype=torch.long), torch.device("cpu"))
    hooks.capturing_now = True  # a graph would read the staged memory at every replay
    ring.upload(torch.zeros(2, dtype=torch.long), torch.device("cpu"))
    assert pinned == [SEGMENT // 8 + 1, 2] and ring.buffer is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, SEGMENT // 4), st.sampled_from(["s0", "s0", "s0", "s1"])),
                min_size=1, max_size=80))
def test_no_staged_memory_is_handed_out_while_a_copy_may_read_it(uploads):
    ring, hooks = ring_with_hooks(segments=3)
    for nbytes, stream in uploads:
        hooks.current_stream = stream
        ring.upload(torch.zeros(nbytes, dtype=torch.uint8), torch.device("cpu"))  # checked_take asserts


def test_a_result_buffer_returns_to_the_pool_only_once_read():
    made = []
    pool = ResultPool(pinned=lambda numel: made.append(numel) or torch.zeros(numel, dtype=torch.float64), keep=2)
    first, second = pool.take(10), pool.take(100)
    assert len(made) == 2 and first.numel() == 10 and second.numel() == 100
    pool.give_back(first)
    third = pool.take(20)  # first's buffer (64 elements at least) is free again
    assert len(made) == 2 and third.data_ptr() == first.data_ptr() and third.numel() == 20
    fourth = pool.take(20)  # second is not back yet: a new one
    assert len(made) == 3 and fourth.data_ptr() != second.data_ptr()
    for view in (second, third, fourth):
        pool.give_back(view)
    assert len(pool.free) == 2  # keep
