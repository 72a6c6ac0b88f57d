"""CPU topology from fake sysfs trees, plus a smoke test on this machine."""
import os
import sys
import threading

import pytest

from engramflow.actors.topology import (allowed_cpus, gpu_numa_node, packages, parse_cpulist, physical_cores,
                                        pin_current_thread)
from engramflow.errors import EngramflowError


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def fake_sysfs(root, layout, numa=True):
    """layout: {cpu: (package, core_id)}; NUMA node = package."""
    for cpu, (package, core) in layout.items():
        topo = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        write(topo / "physical_package_id", f"{package}\n")
        write(topo / "core_id", f"{core}\n")
    if numa:
        for package in sorted({p for p, _ in layout.values()}):
            cpus = sorted(c for c, (p, _) in layout.items() if p == package)
            write(root / "devices/system/node" / f"node{package}" / "cpulist", ",".join(map(str, cpus)) + "\n")
    return root


def two_packages_smt():
    """2 packages × 8 cores × 2 SMT, Linux-style numbering: cpu c and c+16 are siblings."""
    layout = {}
    for thread in range(2):
        for package in range(2):
            for core in range(8):
                layout[thread * 16 + package * 8 + core] = (package, core)
    return layout


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []
    with pytest.raises(EngramflowError, match="x-2"):
        parse_cpulist("x-2")


@pytest.mark.parametrize("numa", [True, False])
def test_two_packages_drop_smt_siblings(tmp_path, numa):
    root = fake_sysfs(tmp_path, two_packages_smt(), numa=numa)
    pk = packages(root, cpus=list(range(32)))
    assert [p.node for p in pk] == [0, 1]
    assert pk[0].cores == tuple(range(0, 8)) and pk[1].cores == tuple(range(8, 16))
    assert pk[0].cpus == tuple(range(0, 8)) + tuple(range(16, 24))
    assert pk[0].selected == pk[0].cores  # 8 cores: below the threshold, all of them
    assert pk[1].package_ids == (1,)


def test_affinity_restricts_and_sibling_stands_in(tmp_path):
    root = fake_sysfs(tmp_path, two_packages_smt())
    # only the second hyperthread of cores 0..3 on package 0, plus all of package 1's first threads
    pk = packages(root, cpus=[16, 17, 18, 19, 8, 9])
    assert [(p.node, p.cores) for p in pk] == [(0, (16, 17, 18, 19)), (1, (8, 9))]


def test_big_package_keeps_a_quarter_free(tmp_path):
    layout = {cpu: (0, cpu) for cpu in range(32)} | {cpu + 32: (0, cpu) for cpu in range(32)}
    root = fake_sysfs(tmp_path, layout)
    (p,) = packages(root, cpus=list(range(64)))
    assert len(p.cores) == 32 and len(p.selected) == 24
    assert set(p.selected) <= set(p.cores) and 0 not in p.selected
    (p16,) = packages(root, cpus=list(range(16)))
    assert len(p16.selected) == 12


def test_missing_topology_falls_back_to_one_core_per_cpu(tmp_path):
    (p,) = packages(tmp_path, cpus=[0, 1, 2])
    assert p.node == 0 and p.cores == (0, 1, 2)
    assert physical_cores([5, 3], tmp_path) == [3, 5]


def test_gpu_numa_node(tmp_path):
    devices = tmp_path / "bus/pci/devices"
    write(devices / "0000:3b:00.0" / "numa_node", "1\n")
    write(devices / "0000:5e:00.0" / "numa_node", "-1\n")
    (devices / "0000:86:00.0").mkdir(parents=True)
    assert gpu_numa_node("0000:3b:00.0", tmp_path) == 1
    assert gpu_numa_node("00000000:3B:00.0", tmp_path) == 1  # CUDA's spelling
    assert gpu_numa_node("5e:00.0", tmp_path) == 0  # -1: unknown -> node 0
    assert gpu_numa_node("0000:86:00.0", tmp_path) == 0  # no numa_node file
    with pytest.raises(EngramflowError, match="0000:99:00.0"):
        gpu_numa_node("0000:99:00.0", tmp_path)
    with pytest.raises(EngramflowError, match="bogus"):
        gpu_numa_node("bogus", tmp_path)


def test_this_machine():
    pk = packages()
    allowed = set(allowed_cpus())
    assert pk and all(p.selected for p in pk)
    assert {c for p in pk for c in p.cpus} == allowed
    assert all(set(p.selected) <= set(p.cores) <= set(p.cpus) for p in pk)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux-only")
def test_pin_current_thread_pins_only_that_thread():
    before = os.sched_getaffinity(0)
    target = min(packages()[0].selected)
    seen = {}

    def worker():
        pin_current_thread([target])
        seen["inside"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["inside"] == {target}
    assert os.sched_getaffinity(0) == before
    with pytest.raises(EngramflowError, match="empty"):
        pin_current_thread([])


def test_pin_process_reaches_threads_that_already_exist():
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, threading
        from engramflow.actors.topology import pin_process
        ev = threading.Event()
        t = threading.Thread(target=ev.wait); t.start()   # a thread made before pinning
        pin_process([0])
        masks = {sorted(os.sched_getaffinity(int(tid)))[0] if len(os.sched_getaffinity(int(tid))) == 1 else -1
                 for tid in os.listdir('/proc/self/task')}
        ev.set(); t.join()
        print(masks)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "{0}"



def test_a_worker_of_the_node_reads_its_packages_as_the_task_does(ray_session):
    """placement.node_packages from a Ray worker (as in a Serve replica) of the node asked about
    reads the topology itself (no task, no worker process started for it) and finds what the
    task would."""
    import ray

    from engramflow.pipeline import placement

    @ray.remote(num_cpus=0)
    def in_a_worker():
        placement._PACKAGES.clear()

        class NoTask:
            def options(self, **kw):
                raise AssertionError("a worker of the node started a task to read its own packages")

        placement._package_cores, task = NoTask(), placement._package_cores
        try:
            return placement.node_packages(ray.get_runtime_context().get_node_id())
        finally:
            placement._package_cores = task

    node = ray.get_runtime_context().get_node_id()
    assert ray.get(in_a_worker.remote()) == (ray.get(placement._package_cores.options(**placement.on_node(node)).remote())
                                             or [None])
