"""The few collectives the loop needs, through torch.distributed (the same on gloo and NCCL).

Each takes the rank's status writer (``status``), when there is one, and waits inside ``status.waiting(...)``: a
rank blocked here for longer than its write interval keeps its status file fresh and says what it waits for,
while a rank that stopped goes stale (``training.status_writer``). ``waiting_allreduce_hook`` does the same for
DDP's gradient all-reduce, inside ``backward``.
"""

from __future__ import annotations

import contextlib

STEP_AGREEMENT = "ranks in all-reduce (step agreement)"
GRADIENTS = "ranks in the gradient all-reduce"


def waiting(status, what: str):
    """``status.waiting(what)``, or nothing without a status writer."""
    return contextlib.nullcontext() if status is None else status.waiting(what)


def agree(accelerator, votes: list[dict[str, int]], status=None) -> dict[str, int]:
    """The step's agreement: every rank's votes (each component's ``{name: integer}``, the same names in the same
    order on every rank) summed over the ranks, in one all-reduce."""
    import torch

    names = [name for vote in votes for name in vote]
    values = [int(value) for vote in votes for value in vote.values()]
    with waiting(status, STEP_AGREEMENT):
        sums = all_reduce_sum(accelerator, torch.tensor(values, dtype=torch.int64, device=accelerator.device))
        return dict(zip(names, (int(value) for value in sums.tolist())))


def all_reduce_sum(accelerator, tensor, status=None, what: str = "ranks in all-reduce"):
    """Sum over ranks, in place (torch.distributed: the same on gloo and NCCL)."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist
        with waiting(status, what):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_from_main(accelerator, value, status=None, what: str = "rank 0's broadcast"):
    """Rank 0's value on every rank (any picklable object)."""
    if accelerator.num_processes == 1:
        return value
    import torch.distributed as dist

    box = [value]
    with waiting(status, what):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_from_all(accelerator, value, status=None, what: str = "ranks at a gather") -> list:
    """Every rank's ``value`` (any picklable object), in rank order. accelerate's gather_object returns its input
    unchanged on CPU ranks; this works on gloo and NCCL."""
    if accelerator.num_processes == 1:
        return [value]
    import torch.distributed as dist

    everyone = [None] * accelerator.num_processes
    with waiting(status, what):
        dist.all_gather_object(everyone, value)
    return everyone


def wait_for_everyone(accelerator, status=None, what: str = "ranks at a barrier") -> None:
    with waiting(status, what):
        accelerator.wait_for_everyone()


def waiting_allreduce_hook(status):
    """A DDP comm hook: PyTorch's default all-reduce (sum, then divided by the world size), inside a wait of the
    status writer from the moment a gradient bucket is ready until its all-reduce completes. On gloo that is
    when the other ranks have sent theirs; NCCL completes the future once the work is queued on the GPU."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(process_group, bucket):
        token = status.begin_wait(GRADIENTS)
        try:
            future = allreduce_hook(process_group, bucket)
        except BaseException:
            status.end_wait(token)
            raise

        def done(completed):
            status.end_wait(token)
            return completed.value()

        return future.then(done)

    return hook


def watch_gradient_all_reduce(module, status) -> bool:
    """Register ``waiting_allreduce_hook`` on a DDP-wrapped module; False where the module is not one."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(module, DistributedDataParallel):
        return False
    module.register_comm_hook(state=None, hook=waiting_allreduce_hook(status))
    return True


EPOCH_START = "ranks at the start of the epoch (the data loader syncs its random state)"


def iterate_waiting_at_start(loader, status=None):
    """Iterate ``loader``; its first batch inside a wait: accelerate's prepared loader broadcasts rank 0's random
    state when an epoch's iteration starts, a collective like the others."""
    iterator = iter(loader)
    with waiting(status, EPOCH_START):
        first = next(iterator, _END)
    if first is _END:
        return
    yield first
    yield from iterator


_END = object()
