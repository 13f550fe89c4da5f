"""The cache job's processes: rank and world size from the launcher's environment, and the few collectives the
job needs (a barrier at the start, rank 0's media sizes for every rank)."""

from __future__ import annotations

import os

from diffsynth_mbc.run_files import rank_from_environment


class Ranks:
    """Rank and world size from the launcher's environment; a gloo/NCCL group only for the start barrier."""

    def __init__(self):
        self.rank, self.local_rank, self.world_size = rank_from_environment()
        self._group = False

    def start(self, use_cuda: bool) -> None:
        if self.world_size > 1:
            import datetime

            import torch
            import torch.distributed as dist

            if use_cuda:
                torch.cuda.set_device(self.local_rank)
            timeout = datetime.timedelta(seconds=int(os.environ.get("NCCL_TIMEOUT", "1800")))
            dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timeout)
            self._group = True

    def barrier(self) -> None:
        if self._group:
            import torch.distributed as dist

            dist.barrier()

    def broadcast(self, value):
        """Rank 0's value (any picklable object) on every rank."""
        if not self._group:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self._group:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group = False
