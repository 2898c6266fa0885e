"""The scheduler's relay of the frontends' request metrics as a pure object: a restarted frontend's dead
process's counts stay in every scrape (the load audit saw them vanish, and scrapes alternate 5 and 10)."""

from llmbus.bus import messages as m
from llmbus.frontend.request_metrics import _add
from llmbus.scheduler.frontend_stats import FrontendStatsRelay


def stats(fid: str, count: int, success: int, failed: int = 0) -> m.FrontendStats:
    return m.FrontendStats(frontend_id=fid, request_count=count, request_success=success,
                           failure_labels=["validation"] if failed else [], failure_counts=[failed] if failed else [],
                           histogram_names=[], histograms=[])


def summed(parts: list[m.FrontendStats]) -> tuple[int, int, dict]:
    total = stats("", 0, 0)
    for part in parts:
        total = _add(total, part)
    return total.request_count, total.request_success, dict(zip(total.failure_labels, total.failure_counts))


def test_a_restarted_frontends_counts_are_kept_and_its_lost_requests_fail():
    relay = FrontendStatsRelay()
    relay.record(stats("f0", 6, 6))
    relay.record(stats("f1", 10, 1, failed=1))  # 8 in flight when it is killed
    told = relay.retire("f1")
    assert [s.frontend_id for s in told] == ["f1~1", "f1"] and told[1].request_count == 0
    # what the survivor sums (its own counts plus what it was told), and what the new f1 is told at its hello
    survivor = summed([told[0], told[1], relay.latest["f0"]])
    assert survivor == (16, 7, {"validation": 1, "internal": 8})
    newcomer = relay.for_frontend("f1")
    assert sorted(s.frontend_id for s in newcomer) == ["f0", "f1~1"]
    relay.record(stats("f1", 2, 2))  # the new process's own
    assert summed(relay.latest.values()) == (18, 9, {"validation": 1, "internal": 8})
    assert relay.retire("f9") == [], "a frontend that never sent counts leaves nothing to keep"
