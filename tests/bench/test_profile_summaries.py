"""benchmarks/stack_overhead.py's summaries of py-spy's collapsed stacks, which gpu_check's part 3 reports: what
one kind of call is made of (a worker's eager steps), inclusive of everything below it."""

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
