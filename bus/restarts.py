"""How often a lost service is restarted, for every service that restarts another: the scheduler restarts
lost worker ranks, the supervisor a frontend that died while others serve (pure: no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field

RESTART_WINDOW_S = 60.0  # what --max-restarts counts within, for worker ranks and frontends alike


@dataclass
class RestartBudget:
    """At most ``max_restarts`` within any ``window_s``; more is a crash loop that restarting only repeats."""

    max_restarts: int
    window_s: float = RESTART_WINDOW_S
    restarts: list[float] = field(default_factory=list)  # monotonic times of the ones in the window

    def allow(self, now: float) -> bool:
        """Whether one more restart fits; if so it is counted."""
        self.restarts = [t for t in self.restarts if now - t < self.window_s]
        if len(self.restarts) >= self.max_restarts:
            return False
        self.restarts.append(now)
        return True
