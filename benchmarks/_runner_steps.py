"""How the device check drives a ``ModelRunner``'s steps: with its CUDA graphs and without, counting the steps
that replayed them, and chained as the worker runs the steps the scheduler sends ahead.

Not a benchmark itself (the leading underscore); gpu_check.py and its parts import it.
"""

from __future__ import annotations

import dataclasses
import time

from llmbus.bus.messages import SAMPLED_LAST
from llmbus.workers.model_runner import ModelRunner, SeqInput


def graph_modes(runner: ModelRunner):
    """Run the caller's body with the runner's decode graphs and piecewise graphs (name suffix ""), then,
    where it captured any, again without them (" eager"): both in one run, on one card. Each yield says the
    decode graph sizes in use."""
    graphs, piecewise = runner.graphs, runner.piecewise
    yield "", list(graphs.sizes) if graphs is not None else []
    if graphs is not None or piecewise is not None:
        runner.graphs = runner.piecewise = None
        try:
            yield " eager", []
        finally:
            runner.graphs, runner.piecewise = graphs, piecewise


def pipelined_steps(runner: ModelRunner, seqs: list[SeqInput], steps: int) -> list[float]:
    """Seconds a step of ``seqs`` takes in a chain run as the worker runs steps sent ahead: each launched
    with its tokens fed from the step before (still on the device), then the step before's tokens read."""
    fed = [dataclasses.replace(s, token_ids=[SAMPLED_LAST]) for s in seqs]
    rows, rids = list(range(len(seqs))), [s.rid for s in seqs]
    launched = runner.launch(seqs)
    launched.result()
    times = []
    for _ in range(steps):
        s0 = time.perf_counter()
        following = runner.launch(fed, launched.feed(rows, rids))
        launched.result()
        launched = following
        times.append(time.perf_counter() - s0)
    launched.result()
    return times


def count_replays(runner: ModelRunner) -> list[int]:
    """[decode steps that replay the runner's decode graphs, steps that run its piecewise graphs], counted from
    now on."""
    count = [0, 0]
    if runner.graphs is not None:
        replay = runner.graphs.forward

        def counted(seqs, feed=None):
            count[0] += 1
            return replay(seqs, feed)
        runner.graphs.forward = counted
    if runner.piecewise is not None:
        pieces = runner.piecewise.forward

        def counted_pieces(*args):
            count[1] += 1
            return pieces(*args)
        runner.piecewise.forward = counted_pieces
    return count


def timed_steps(runner: ModelRunner, seqs: list[SeqInput], warm: int, timed: int) -> list[float]:
    """Seconds of each of ``timed`` steps of ``seqs`` one at a time (each returns with its tokens on the host),
    after ``warm`` steps that compile and warm what the shape runs."""
    for _ in range(warm):
        runner.step(seqs)
    times = []
    for _ in range(timed):
        s0 = time.perf_counter()
        runner.step(seqs)
        times.append(time.perf_counter() - s0)
    return times
