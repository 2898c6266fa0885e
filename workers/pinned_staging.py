"""Pinned host memory a rank stages its copies through, pinned once rather than per copy (issue #39).

A copy to the GPU that does not wait must come from pinned memory, and so must one back that the host reads
once an event says it landed. Pinning per copy (``tensor.pin_memory()``, ``torch.empty(pin_memory=True)``)
goes through torch's caching host allocator and its events for the blocks in flight: on run 14's host a
result copy cost about 70 us of host time, and a step with prompt rows makes several uploads besides (design
notes, "What a prompt-chunk step's host time is").

- ``UploadRing``: copies to the device. One pinned buffer in segments used in turn; a segment is closed with an
  event recorded on the stream its copies were queued on, and used again only once that event has passed (on
  a served GPU long since: the other segments were filled in between). A copy on another stream than its
  segment's closes that segment first; one larger than a segment, or queued while a stream captures a graph
  (the graph would read that memory at every replay), pins memory of its own, as before.
- ``ResultPool``: copies to the host. A buffer goes back to the pool only once the host has read it, so no
  later copy can overwrite a result not yet read, whatever the steps in flight.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

# 16 segments of 256 KiB: a step's uploads are kilobytes (a 32k-token prompt's ids, positions and slots about
# 0.8 MB go past a segment and pin their own), and a segment comes round again 15 segments later.
SEGMENT_BYTES = 256 * 1024
SEGMENTS = 16
ALIGN = 64  # bytes: every staged copy starts on a cache line (and Triton's 16-byte alignment)


def _pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    # A normal tensor even when first asked for inside inference mode (a step's launch): an inference tensor
    # may not be written in place outside it, and these buffers outlive the call that made them.
    with torch.inference_mode(False):
        return torch.empty(numel, dtype=dtype, pin_memory=True)


class CudaHooks:
    """What the staging needs of CUDA, apart so the CPU tests can stand in for it."""

    @staticmethod
    def pinned(nbytes: int) -> torch.Tensor:
        return _pinned(nbytes, torch.uint8)

    @staticmethod
    def stream():
        return torch.cuda.current_stream()

    @staticmethod
    def capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    @staticmethod
    def event_on(stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event


class UploadRing:
    """Pinned staging for host-to-device copies, segment by segment (module docstring)."""

    def __init__(self, hooks=CudaHooks, segment_bytes: int = SEGMENT_BYTES, segments: int = SEGMENTS):
        self.hooks, self.segment_bytes, self.segments = hooks, segment_bytes, segments
        self.buffer: torch.Tensor | None = None  # pinned on first use: a rank that never stages pins nothing
        self.current = 0  # the segment being filled
        self.used = 0  # bytes of it handed out
        self.stream = None  # the stream its copies were queued on
        self.fences: list = [None] * segments  # the event each segment was closed with, until it is reused
        self.lock = threading.Lock()  # the grammar's mask thread stages beside the step's thread

    def upload(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` (contiguous, on the CPU) on ``device``, copied without waiting."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.segment_bytes or self.hooks.capturing():
            return tensor.pin_memory().to(device, non_blocking=True)
        with self.lock:
            staged = self._take(nbytes)
            view = staged.view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            return view.to(device, non_blocking=True)

    def _take(self, nbytes: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = self.hooks.pinned(self.segment_bytes * self.segments)
        stream = self.hooks.stream()
        if self.used + nbytes > self.segment_bytes or (self.used and stream != self.stream):
            self._next_segment()
        self.stream = stream
        start = self.current * self.segment_bytes + self.used
        self.used += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return self.buffer[start:start + nbytes]

    def _next_segment(self) -> None:
        """Close the segment being filled (an event after its copies) and open the next, once the copies of
        its last use have run."""
        self.fences[self.current] = self.hooks.event_on(self.stream)
        self.current = (self.current + 1) % self.segments
        fence, self.fences[self.current] = self.fences[self.current], None
        if fence is not None:
            fence.synchronize()
        self.used = 0


class ResultPool:
    """Pinned buffers for device-to-host copies, each back in the pool once the host has read it."""

    def __init__(self, pinned: Callable[[int], torch.Tensor] | None = None, keep: int = 8):
        self.pinned = pinned or (lambda numel: _pinned(numel, torch.float64))
        self.keep = keep  # buffers kept free: a few steps in flight, and one for each size a step takes
        self.free: list[torch.Tensor] = []
        self.lock = threading.Lock()

    def take(self, numel: int) -> torch.Tensor:
        """A float64 buffer of ``numel`` elements (a view of a pooled one at least as long)."""
        with self.lock:
            for i, buffer in enumerate(self.free):
                if buffer.numel() >= numel:
                    return self.free.pop(i)[:numel]
        return self.pinned(max(numel, 64))[:numel]

    def give_back(self, view: torch.Tensor) -> None:
        """``take``'s buffer, read: another copy may land in it now."""
        base = view._base if view._base is not None else view
        with self.lock:
            if len(self.free) < self.keep:
                self.free.append(base)


UPLOADS = UploadRing()
RESULTS = ResultPool()
