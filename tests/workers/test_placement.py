"""How many threads a CPU rank computes with: the physical cores of its affinity mask and a cgroup's CPU quota,
read from fake Linux topology and cgroup trees (``cpu_budget``'s paths), and the share a rank gets of them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmbus.workers.placement import CpuBudget, cgroup_cpu_quota, cpu_budget


def topology(root: Path, cores: dict[int, tuple[int, int]]) -> Path:
    """A sysfs cpu folder where CPU n sits on (package, core) ``cores[n]``."""
    for cpu, (package, core) in cores.items():
        folder = root / "cpu" / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "physical_package_id").write_text(f"{package}\n")
        (folder / "core_id").write_text(f"{core}\n")
    return root / "cpu"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def affinity(monkeypatch):
    def set_cpus(cpus):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cpus))
    return set_cpus


def test_smt_siblings_are_one_core(tmp_path, affinity):
    # 8 CPUs, two hyperthreads on each of 4 cores, over two packages whose core ids repeat
    sysfs = topology(tmp_path, {cpu: (cpu // 4, (cpu % 4) // 2) for cpu in range(8)})
    affinity(range(8))
    budget = cpu_budget(sysfs, tmp_path / "none", tmp_path / "none")
    assert (budget.cpus, budget.cores, budget.quota) == (8, 4, None)
    assert budget.threads(1) == 4
    affinity([0, 1, 2])  # a mask holding both siblings of core 0 and one of core 1
    assert cpu_budget(sysfs, tmp_path / "none", tmp_path / "none").cores == 2


def test_unreadable_topology_counts_each_cpu(tmp_path, affinity):
    affinity(range(6))
    budget = cpu_budget(tmp_path / "absent", tmp_path / "none", tmp_path / "none")
    assert (budget.cpus, budget.cores) == (6, 6)


def test_cgroup_v2_quota_is_the_tightest_of_the_path(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/machine/container\n")
    write(root / "cpu.max", "max 100000\n")
    write(root / "machine" / "cpu.max", "800000 100000\n")
    write(root / "machine" / "container" / "cpu.max", "250000 100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") == 2.5
    write(root / "machine" / "container" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") == 8.0
    write(root / "machine" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") is None


def test_cgroup_v1_quota(tmp_path):
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "400000\n")
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(root, tmp_path / "self") == 4.0
    write(root / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cgroup_cpu_quota(root, tmp_path / "self") is None
    assert cgroup_cpu_quota(root, tmp_path / "absent") is None


def test_quota_caps_the_threads(tmp_path, affinity):
    # a container given 3.5 CPUs of a 16-core machine: a fourth busy thread would be throttled
    root = tmp_path / "cgroup"
    write(tmp_path / "self", "0::/\n")
    write(root / "cpu.max", "350000 100000\n")
    affinity(range(16))
    budget = cpu_budget(tmp_path / "absent", root, tmp_path / "self")
    assert (budget.cores, budget.quota, budget.usable, budget.reserved) == (16, 3.5, 3, 0)
    assert budget.threads(1) == 3
    assert "quota 3.5 CPUs" in budget.describe()


@pytest.mark.parametrize("budget,threads,said", [
    (CpuBudget(cpus=2, cores=2), 2, "2 CPUs, 2 cores"),
    (CpuBudget(cpus=32, cores=16), 14, "32 CPUs, 16 cores, 2 left to serving"),
    (CpuBudget(cpus=16, cores=16, quota=0.5), 1, "16 CPUs, 16 cores, quota 0.5 CPUs"),
])
def test_budget_threads_and_description(budget, threads, said):
    assert budget.threads(1) == threads
    assert budget.describe() == said
