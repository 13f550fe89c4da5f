"""The LoRA's health, from ``{"kind": "lora_health"}`` history records and the status files' ``health``. No torch.

The training appends a health record at step 0, every ``--health_steps`` optimizer steps and at the end
(``training/components/lora_health.py``): ``update_norm_by_block`` (``|dW|_F / |W|_F`` per DiT block: how far
the LoRA has moved each block), ``grad_norm_by_block`` (null where not measured) and the ``flags`` raised then.
A health record has a step but is no training step: the history reads it here and nowhere else.

Per rank this keeps the records for the dashboard's heat map (blocks x record steps), bounded: past
``MAX_RECORDS`` every other record between the first and the newest is dropped, so a long run keeps its whole
span at a coarser step (a resumed run's repeated steps: the newer record wins). ``run_flags`` gathers the newest
flags of every rank's status file, the same flag on several ranks (DDP: every rank holds the same LoRA) said
once with its ranks.
"""

from __future__ import annotations

from diffsynth_mbc.monitor.status import health_flags_of, to_float

MAX_BLOCKS = 1024     # blocks kept per record (Wan2.2-TI2V-5B's DiT has 30)
MAX_RECORDS = 400     # records kept per rank before thinning
MAX_RUN_FLAGS = 32    # distinct flags the run shows


def block_norms(value) -> list[float | None] | None:
    """A per-block norm list (None for a block whose norm is not a finite number); None when not a list."""
    if type(value) is not list:
        return None
    return [to_float(v) for v in value[:MAX_BLOCKS]]


class HealthRecords:
    """One rank's LoRA health records, in step order (see the module's docstring)."""

    __slots__ = ("most", "records")

    def __init__(self, most: int = MAX_RECORDS):
        self.most = max(4, int(most))
        self.records: list[dict] = []

    def add(self, step: float, record: dict) -> None:
        """One ``lora_health`` record; one without a per-block update list is left out."""
        updates = block_norms(record.get("update_norm_by_block"))
        if updates is None:
            return
        while self.records and self.records[-1]["step"] >= step:   # a resumed run repeats steps: the newer wins
            self.records.pop()
        self.records.append({
            "step": step, "update_norm_by_block": updates,
            "grad_norm_by_block": block_norms(record.get("grad_norm_by_block")),
            "flags": [item["flag"] for item in health_flags_of(record.get("flags"))],
        })
        if len(self.records) > self.most:
            self.records = self.records[:1] + self.records[2:-1:2] + self.records[-1:]

    def as_list(self, since: float | None = None) -> list[dict]:
        """``[{step, update_norm_by_block, grad_norm_by_block, flags: [names]}]`` with a step above ``since``."""
        return [record for record in self.records if since is None or record["step"] > since]


def run_flags(ranks: list[dict]) -> list[dict]:
    """The newest LoRA health flags of every rank (its status file's ``health.flags``): ``[{"flag", "step", "what",
    "do", "ranks"}]``, one item per distinct flag, in rank order."""
    groups: dict[tuple, dict] = {}
    for rank in sorted(ranks, key=lambda r: r["rank"]):
        health = rank.get("health")
        for item in (health.get("flags") or []) if isinstance(health, dict) else []:
            key = (item.get("flag"), item.get("step"), item.get("what"), item.get("do"))
            if key not in groups and len(groups) >= MAX_RUN_FLAGS:
                continue
            groups.setdefault(key, {**item, "ranks": []})["ranks"].append(rank["rank"])
    return list(groups.values())
