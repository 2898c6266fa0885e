"""What gpu_check's part 3 reports beside its numbers, from what a GPU run leaves: py-spy's collapsed stacks
below one kind of call (benchmarks/stack_overhead.py: a worker's eager steps, inclusive of everything below),
and the idle row summed from rank 0's device timeline lines."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from stack_overhead import summarize_under  # noqa: E402


def test_time_below_a_call_by_its_callees_leaves_out_the_stacks_through_another(tmp_path):
    loop = "main (w.py:1);Worker.loop (process.py:9);ModelRunner._forward (model_runner.py:183)"
    collapsed = tmp_path / "workers.txt"
    collapsed.write_text("\n".join([
        f"{loop};PiecewiseGraphs.forward (p.py:90);_Plan.run (p.py:170);CUDAGraph.replay (g.py:1) 30",
        f"{loop};PiecewiseGraphs.forward (p.py:90);_Plan.run (p.py:171);PiecewiseGraphs._attend (p.py:1) 50",
        f"{loop};TritonAttentionBackend.build_metadata (t.py:80);step_index (b.py:1) 15",
        f"{loop} 5",
        f"{loop};DecodeGraphs.forward (c.py:190);DecodeGraphs._stage (c.py:230) 400",  # a replayed step
        "main (w.py:1);Worker._next_message (process.py:383) 99",  # not a step at all
    ]) + "\n")
    eager = summarize_under(collapsed, "ModelRunner._forward", "DecodeGraphs.forward").splitlines()
    assert eager[0] == "  100 samples under ModelRunner._forward without DecodeGraphs.forward:"
    assert eager[1:] == ["     80.0%  PiecewiseGraphs.forward", "     15.0%  TritonAttentionBackend.build_metadata",
                         "      5.0%  (self)"]
    parts = summarize_under(collapsed, "PiecewiseGraphs.forward", depth=2).splitlines()
    assert parts[1:] == ["     62.5%  _Plan.run > PiecewiseGraphs._attend", "     37.5%  _Plan.run > CUDAGraph.replay"]


def test_the_idle_row_sums_rank_0s_windows_of_a_loaded_wave():
    """gpu_check part 3's idle row from rank 0's "device timeline" lines (only a GPU logs them, so the dry run
    never reaches this): the windows of the loaded wave only, the eager steps' share of the idle, and the
    garbage collector's pauses."""
    import types

    import torch
    from gpu_check_served import ServedPart

    line = ("device timeline steps={steps} mean_rows={rows} busy_ms={busy} idle_ms={idle} idle_share=0.1 "
            "eager_steps={eager} eager_idle_ms={eager_idle} step_busy_ms=1.25 host_launch_ms=0.8 host_apply_ms=0.07 "
            "eager_launch_ms=2.9 host_wait_ms=0.3 turnaround_ms=0.2 gc_collections={gc} gc_full={full} "
            "gc_ms={gc_ms} gc_longest_ms={longest}")
    lines = [line.format(steps=10, rows=3.0, busy=900.0, idle=100.0, eager=1, eager_idle=90.0, gc=5, full=1,
                         gc_ms=200.0, longest=199.0),  # before the wave: few rows, left out
             line.format(steps=100, rows=60.0, busy=950.0, idle=50.0, eager=10, eager_idle=30.0, gc=40, full=0,
                         gc_ms=4.0, longest=0.5),
             line.format(steps=100, rows=64.0, busy=950.0, idle=50.0, eager=10, eager_idle=20.0, gc=40, full=1,
                         gc_ms=120.0, longest=110.0)]
    rows = []
    part = types.SimpleNamespace(sizes=types.SimpleNamespace(throughput=(64, 128, 128)), device=torch.device("cuda"),
                                 args=types.SimpleNamespace(steps_ahead=2, launch_depth=1, piecewise_graphs=None),
                                 row=lambda *a, **kw: rows.append((a, kw)))
    ServedPart._device_idle(part, lines, {"answered": 900}, {})
    ((_, name, ok, summary), details), = rows
    assert name == "c=64 device idle" and ok and details["idle_share"] == 0.05
    assert "50% of the idle before the 10% of steps launched eagerly" in summary, summary
    assert "rank 0's garbage collection 124.0 ms (1 full, the longest 110.0 ms)" in summary, summary
    assert "(2 windows of 3, 900 requests)" in summary, summary
