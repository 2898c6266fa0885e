"""`llmbus workers --gpus N`: one entry that owns every rank of a tensor-parallel group.

It spawns ranks 0..N-1 as child processes and treats them as one unit: when any rank exits, the others
are stopped (SIGTERM, then SIGKILL after a grace period) and the group exits with the first failing
rank's code. A dead rank therefore never leaves the others blocked in a collective, and under honcho a
single Procfile entry (one process group) takes the whole TP group down with it. A group of one rank
runs that rank in its own process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys

import structlog

from llmbus.bus.rundir import ensure_run_dir_or_exit
from llmbus.bus.service import die_with_parent, setup_logging, terminate_all
from llmbus.workers.placement import gpu_shortage
from llmbus.workers.process import WorkerConfig, default_dist_init_file, run_worker

GRACE_S = 5.0


def run_group(argv: list[str], world_size: int) -> int:
    setup_logging("workers")
    die_with_parent()
    log = structlog.get_logger("llmbus.workers")
    procs = [subprocess.Popen([sys.executable, "-m", "llmbus.workers", *argv, "--rank", str(rank)])
             for rank in range(world_size)]
    by_pid = {p.pid: (rank, p) for rank, p in enumerate(procs)}
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    pid, status = os.waitpid(-1, 0)
    code = os.waitstatus_to_exitcode(status)
    rank, proc = by_pid[pid]
    proc.returncode = code
    if code != 0 and not stopping:
        what = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
        log.error("rank exited; stopping the group", rank=rank, exit=what)
    terminate_all(procs, GRACE_S)
    codes = [code] + [p.returncode for p in procs if p is not proc]
    failed = [c for c in codes if c not in (0, -signal.SIGTERM)] if stopping else [c for c in codes if c != 0]
    if not failed:
        return 0
    first = failed[0]
    return 128 - first if first < 0 else first


# libgomp (torch's CPU thread pool) lets an idle thread spin 300,000 times before it sleeps. A rank uses
# every core it is given while the frontend and scheduler share the same cores, so a preempted thread
# leaves its partner spinning at each parallel op, and steps stretch many times over under load. A short
# spin keeps the fast handoff between ops and gives the core back quickly; sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) slows small steps (design notes, "OpenMP threads give their core back
# quickly"). Read by libgomp when torch loads, so set here, before any rank imports torch; an operator's own
# setting wins.
GOMP_SPINCOUNT = "10000"

# torch's CPU allocator puts blocks of 2 MB or more (weights, the KV pool, a prompt step's activations) on
# 2 MB pages when this is set, where the kernel's transparent huge pages are "madvise" (the common default)
# or "always": fewer TLB misses where decode attention reads the pool's scattered 4 KB blocks, a small gain
# at every batch size (design notes, "Large CPU blocks on 2 MB pages"). Read once, at torch's first
# allocation: set before any rank imports torch.
THP_MEM_ALLOC_ENABLE = "1"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", THP_MEM_ALLOC_ENABLE)
    cfg, _ = WorkerConfig.parse(argv, prog="llmbus workers")
    ensure_run_dir_or_exit(cfg.run_dir, "llmbus workers")
    if cfg.rank is None:
        shortage = gpu_shortage(cfg.device, cfg.world_size)
        if shortage is not None:
            print(f"llmbus workers: {shortage}", file=sys.stderr)
            return 2
        if cfg.world_size == 1:
            # The group's one rank is this process: a child would start another interpreter and import
            # everything again, a visible part of every launch's time to ready (design notes, "Every service
            # starts at once"). It exits as the group would.
            return run_worker(dataclasses.replace(cfg, rank=0))
        if cfg.dist_init is None:
            # torch.distributed's file store: one left by a group that was killed (and is now restarted)
            # holds that group's keys, which the new ranks must not read
            with contextlib.suppress(FileNotFoundError):
                os.unlink(default_dist_init_file(cfg.run_dir))
        return run_group(argv, cfg.world_size)
    return run_worker(cfg)
