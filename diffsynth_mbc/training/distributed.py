"""The few collectives the loop needs, through torch.distributed (the same on gloo and NCCL)."""

from __future__ import annotations


def agree(accelerator, torch, stop_requested: bool, checkpoint_due: bool, bad: int, seen: int):
    """All ranks learn: did any rank get a stop request / reach the checkpoint time; bad and seen in total."""
    flags = all_reduce_sum(accelerator, torch.tensor([int(stop_requested), int(checkpoint_due), bad, seen],
                                                     dtype=torch.int64, device=accelerator.device))
    stop_any, due_any, bad_total, seen_total = (int(v) for v in flags.tolist())
    return stop_any > 0, due_any > 0, bad_total, seen_total


def all_reduce_sum(accelerator, tensor):
    """Sum over ranks, in place (torch.distributed: the same on gloo and NCCL)."""
    if accelerator.num_processes > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_from_main(accelerator, value):
    """Rank 0's value on every rank (any picklable object)."""
    if accelerator.num_processes == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
