"""Two nodes on one machine for the tests: two launchers with --demo --multinode started seconds apart (one CPU
process each, gloo), as a several-node run is started by hand on each node."""

from __future__ import annotations

import subprocess
import threading
import time

from e2e_helpers import REPO, isolated_env, kill_tree

LAUNCHER = str(REPO / "launchers" / "train_test.sh")


def start_nodes(work, port, *args, log_dirs=(None, None), delay_s=2.5):
    nodes = []
    for machine_rank in (0, 1):
        extra = ["--log_dir", str(log_dirs[machine_rank])] if log_dirs[machine_rank] else []
        env = isolated_env(work, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NUM_MACHINES=2,
                           MACHINE_RANK=machine_rank, OMP_NUM_THREADS=1)
        nodes.append(subprocess.Popen(["bash", LAUNCHER, "--demo", "--multinode", "--buckets", "aspect", *args, *extra],
                                      cwd=work, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if machine_rank == 0:
            time.sleep(delay_s)   # nodes are never started at the same instant
    return nodes


def finish(nodes, timeout=300):
    """Wait for every node; a node that fails ends the wait for all (the other one would wait for it until its
    rendezvous timeout), and the assertion shows each node's output. Outputs are read all along, so a node
    never blocks on a full pipe."""
    outputs = [""] * len(nodes)

    def read(index):
        outputs[index] = nodes[index].communicate()[0]

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(nodes))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    while any(node.poll() is None for node in nodes):
        if any(node.poll() not in (None, 0) for node in nodes) or time.monotonic() > deadline:
            for node in nodes:
                if node.poll() is None:
                    kill_tree(node.pid)
            break
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=60)
    report = "\n".join(f"--- node {r} (exit {n.poll()}):\n{o[-3000:]}" for r, (n, o) in enumerate(zip(nodes, outputs)))
    assert all(node.poll() == 0 for node in nodes), report
    return outputs
