"""Each frontend's request metrics, as the scheduler relays them between frontends (pure: no I/O).

Every frontend sends its ``FrontendStats`` (counts since it started) to the scheduler, which passes the latest
of each to the others, so a scrape of any frontend sums all of them. A frontend that dies and is restarted
counts from 0 again under the same id: its dead process's last counts are kept apart under an id no live
frontend sends, so no counter a scrape reports ever goes down.
"""

from __future__ import annotations

import dataclasses

from llmbus.bus import messages as m


def _nothing(frontend_id: str) -> m.FrontendStats:
    return m.FrontendStats(frontend_id=frontend_id, request_count=0, request_success=0, failure_labels=[],
                           failure_counts=[], histogram_names=[], histograms=[])


class FrontendStatsRelay:
    def __init__(self) -> None:
        self.latest: dict[str, m.FrontendStats] = {}  # by frontend id, retired ones included
        self.retired = 0

    def record(self, stats: m.FrontendStats) -> None:
        self.latest[stats.frontend_id] = stats

    def for_frontend(self, frontend_id: str) -> list[m.FrontendStats]:
        """What a frontend that just said hello is told: every other's latest."""
        return [stats for other, stats in self.latest.items() if other != frontend_id]

    def retire(self, frontend_id: str) -> list[m.FrontendStats]:
        """``frontend_id`` was restarted: what the other frontends are told (the dead process's counts under
        their own id, its requests still in flight counted as failed, ``internal``; then its id from nothing)."""
        old = self.latest.pop(frontend_id, None)
        if old is None:
            return []
        self.retired += 1
        lost = old.request_count - old.request_success - sum(old.failure_counts)
        labels, counts = list(old.failure_labels), list(old.failure_counts)
        if lost > 0:
            if "internal" not in labels:
                labels, counts = [*labels, "internal"], [*counts, 0]
            counts[labels.index("internal")] += lost
        kept = dataclasses.replace(old, frontend_id=f"{frontend_id}~{self.retired}", failure_labels=labels,
                                   failure_counts=counts)
        self.latest[kept.frontend_id] = kept
        return [kept, _nothing(frontend_id)]
