"""Rank health probes: which /health checks wait, and which ranks still owe an answer (pure: no I/O).

A check is answered ok only once every rank has acknowledged a probe sent after the check arrived, so a
rank that is alive but stuck (a hung collective, a stopped process) fails /health instead of passing on
its last sign of life. Checks that arrive while a probe is out share the next probe; one probe is out at
a time, so a load balancer polling /health costs the ranks one tiny message per poll at most.

A busy engine answers sooner: the probe waits behind the steps the ranks have queued (two long prompt
steps on a CPU outlast --health-check-timeout), so a step's result arriving after a check answers it ok
instead. Rank 0 returns a result only when every rank computed the step with it; a stuck group sends none,
and then its step deadline restarts it as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass
class PendingCheck:
    frontend_id: str
    check_id: int
    deadline: float  # monotonic


@dataclass
class Answer:
    frontend_id: str
    check_id: int
    ok: bool
    message: str = ""


@dataclass
class RankHealth:
    world_size: int
    probe_id: int = 0  # of the probe out (or the last one sent)
    owed: set[int] = field(default_factory=set)  # ranks yet to acknowledge the probe out
    covered: list[PendingCheck] = field(default_factory=list)  # checks the probe out answers
    queued: list[PendingCheck] = field(default_factory=list)  # checks that arrived after it was sent

    def check(self, frontend_id: str, check_id: int, timeout_s: float, now: float) -> None:
        self.queued.append(PendingCheck(frontend_id, check_id, now + timeout_s))

    def probe_to_send(self) -> int | None:
        """The id of a probe to broadcast now, if checks wait and none is out."""
        if self.owed or not self.queued:
            return None
        self.probe_id += 1
        self.owed = set(range(self.world_size))
        self.covered, self.queued = self.queued, []
        return self.probe_id

    def ack(self, rank: int, probe_id: int) -> list[Answer]:
        if probe_id != self.probe_id or rank not in self.owed:
            return []  # a late answer to a probe that already timed out
        self.owed.discard(rank)
        if self.owed:
            return []
        answered, self.covered = self.covered, []
        return [Answer(c.frontend_id, c.check_id, True) for c in answered]

    def progress(self) -> list[Answer]:
        """A step's result arrived: every check waiting is answered ok (the probe out stays owed; its
        acknowledgements, when they come, answer nobody)."""
        answered, self.covered, self.queued = self.covered + self.queued, [], []
        return [Answer(c.frontend_id, c.check_id, True) for c in answered]

    def expire(self, now: float) -> list[Answer]:
        """Failures for the checks whose time is up. Once none waits on the probe out, it is given up:
        later checks get a fresh probe rather than waiting on a rank that may never answer it."""
        answers = []
        # checks queued behind the probe out wait on the same ranks as those it covers
        missing = ", ".join(map(str, sorted(self.owed)))
        for pending in (self.covered, self.queued):
            for c in [c for c in pending if c.deadline <= now]:
                pending.remove(c)
                answers.append(Answer(c.frontend_id, c.check_id, False,
                                      f"worker rank(s) {missing} did not answer a health probe in time"))
        if not self.covered:
            self.owed = set()
        return answers

    def fail_all(self, message: str) -> list[Answer]:
        """The ranks are gone (being restarted): every waiting check fails now, and no probe is out."""
        answers = [Answer(c.frontend_id, c.check_id, False, message) for c in self.covered + self.queued]
        self.covered, self.queued, self.owed = [], [], set()
        return answers

    def next_deadline(self) -> float | None:
        deadlines = [c.deadline for c in self.covered + self.queued]
        return min(deadlines) if deadlines else None

