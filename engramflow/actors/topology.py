"""CPU topology for placing the Engram projection threads (docs/architecture.md, "Actors").

A projection actor serves the tables of one NUMA node with threads pinned to that node's
physical cores: one logical CPU per core (SMT siblings share the core's FMA units and caches,
so a second GEMM thread there only adds contention), and only ¾ of the cores on a node with 16
or more, leaving the rest to Ray's own threads, IO and the OS.

Everything is read from `os.sched_getaffinity(0)` (what this process may use: containers and
taskset shrink it) and sysfs. Every function takes `sysfs_root` so tests can point it at a fake
tree. Missing files degrade gracefully: no NUMA directory -> group by physical package; no
topology files -> every CPU is its own core on package 0.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from engramflow.errors import EngramflowError

SYSFS = "/sys"
MIN_CORES_TO_SPARE = 16  # from this many physical cores on, keep a quarter free


@dataclass(frozen=True)
class Package:
    """One NUMA node (or physical package when the kernel exposes no NUMA nodes)."""
    node: int                  # NUMA node id (the physical package id on a NUMA-less system)
    package_ids: tuple[int, ...]  # physical packages with CPUs on this node
    cpus: tuple[int, ...]      # allowed logical CPUs, SMT siblings included
    cores: tuple[int, ...]     # one allowed logical CPU per physical core
    selected: tuple[int, ...]  # the cores projection threads should pin to


def parse_cpulist(text: str) -> list[int]:
    """Kernel cpulist format: '0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise EngramflowError(f"malformed cpulist {text.strip()!r}") from None
    return cpus


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def allowed_cpus() -> list[int]:
    """Logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_location(cpu: int, sysfs_root: str | Path = SYSFS) -> tuple[int, int]:
    """(physical package id, core id) of a logical CPU; (0, cpu) when sysfs does not say."""
    topo = Path(sysfs_root) / "devices/system/cpu" / f"cpu{cpu}" / "topology"
    package = _read_int(topo / "physical_package_id")
    core = _read_int(topo / "core_id")
    if core is None:
        return 0, cpu
    return (0 if package is None or package < 0 else package), core


def numa_nodes(sysfs_root: str | Path = SYSFS) -> dict[int, list[int]]:
    """NUMA node id -> its logical CPUs (all of them, allowed or not); {} without NUMA info."""
    nodes = {}
    base = Path(sysfs_root) / "devices/system/node"
    for d in sorted(base.glob("node[0-9]*")):
        try:
            nodes[int(d.name[4:])] = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def physical_cores(cpus: list[int], sysfs_root: str | Path = SYSFS) -> list[int]:
    """The lowest-numbered logical CPU of each physical core among `cpus`."""
    first: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus):
        first.setdefault(cpu_location(cpu, sysfs_root), cpu)
    return sorted(first.values())


def select_cores(cores: list[int]) -> list[int]:
    """¾ of the cores from 16 on; the lowest-numbered quarter is left out because CPU 0 and its
    neighbours usually carry interrupts and housekeeping."""
    if len(cores) < MIN_CORES_TO_SPARE:
        return list(cores)
    keep = len(cores) * 3 // 4
    return sorted(cores)[len(cores) - keep:]


def packages(sysfs_root: str | Path = SYSFS, cpus: list[int] | None = None) -> list[Package]:
    """The NUMA nodes (or packages) holding allowed CPUs, with their cores and selection."""
    cpus = sorted(allowed_cpus() if cpus is None else cpus)
    groups: dict[int, list[int]] = {}
    nodes = numa_nodes(sysfs_root)
    if nodes:
        node_of = {cpu: node for node, members in nodes.items() for cpu in members}
        for cpu in cpus:
            groups.setdefault(node_of.get(cpu, 0), []).append(cpu)
    else:
        for cpu in cpus:
            groups.setdefault(cpu_location(cpu, sysfs_root)[0], []).append(cpu)
    out = []
    for node, members in sorted(groups.items()):
        cores = physical_cores(members, sysfs_root)
        package_ids = sorted({cpu_location(cpu, sysfs_root)[0] for cpu in members})
        out.append(Package(node, tuple(package_ids), tuple(members), tuple(cores), tuple(select_cores(cores))))
    return out


def _normalize_pci(address: str) -> str:
    """'00000000:3B:00.0' (CUDA's 8-digit domain) or '3b:00.0' -> '0000:3b:00.0' (sysfs)."""
    address = address.strip().lower()
    parts = address.split(":")
    if len(parts) == 2:
        parts.insert(0, "0000")
    if len(parts) != 3 or "." not in parts[2]:
        raise EngramflowError(f"malformed PCI address {address!r} (expected domain:bus:device.function)")
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def gpu_numa_node(pci_address: str, sysfs_root: str | Path = SYSFS) -> int:
    """NUMA node of a PCI device. The kernel reports -1 when it does not know (single-node
    machines, most VMs); that, or a missing numa_node file, counts as node 0."""
    device = Path(sysfs_root) / "bus/pci/devices" / _normalize_pci(pci_address)
    if not device.exists():
        raise EngramflowError(f"no PCI device {pci_address!r} under {device.parent}")
    node = _read_int(device / "numa_node")
    return 0 if node is None or node < 0 else node


def pin_current_thread(cpus) -> None:
    """Restrict the calling thread to `cpus` (Linux: affinity is per thread for pid 0).
    Elsewhere a no-op with a warning: placement is a speed matter, never a correctness one."""
    cpus = sorted({int(c) for c in cpus})
    if not cpus:
        raise EngramflowError("cannot pin a thread to an empty CPU set")
    if not hasattr(os, "sched_setaffinity") or not sys.platform.startswith("linux"):
        warnings.warn(f"thread pinning is not supported on {sys.platform}; CPUs {cpus} ignored", stacklevel=2)
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:
        raise EngramflowError(f"cannot pin thread to CPUs {cpus}: {e.strerror}") from None


def pin_process(cpus) -> None:
    """Restrict every thread of this process to `cpus`. Linux affinity is per thread, and an
    actor's method threads (Ray's executor, torch's pools) may exist before the constructor
    runs; threads made later inherit their creator's mask."""
    cpus = sorted({int(c) for c in cpus})
    pin_current_thread(cpus)  # checks, warns off Linux
    if not sys.platform.startswith("linux"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile
