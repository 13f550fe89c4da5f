"""A short NCCL all-reduce between all local GPUs: the bus bandwidth the training's gradient sync will see."""

from __future__ import annotations

import os
import socket
import time

SIZE_BYTES = 256 * 2**20
ROUNDS = 10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        data = torch.ones(SIZE_BYTES // 2, dtype=torch.float16, device="cuda")
        dist.all_reduce(data)   # warm-up: connections and buffers
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(ROUNDS):
            dist.all_reduce(data)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / ROUNDS
        if rank == 0:
            # NCCL's "bus bandwidth": what each link carries in a ring all-reduce.
            results.put(SIZE_BYTES * 2 * (world_size - 1) / world_size / seconds / 1e9)
    finally:
        dist.destroy_process_group()


def all_reduce_bandwidth(world_size: int) -> float:
    """GB/s of bus bandwidth for a 256 MiB fp16 all-reduce over ``world_size`` local GPUs."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_worker, args=(world_size, _free_port(), results), nprocs=world_size, start_method="spawn")
    return results.get()
