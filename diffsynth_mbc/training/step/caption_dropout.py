"""``--caption_dropout P``: a share P of the training samples train on the empty prompt.

Decided per sample on the rank that trains it, from (--seed, rank, epoch, batch in the epoch, place in the batch)
(``data.caption_rules.dropped``), just before the forward: no random number is drawn, so the noise and timesteps
are those of a run without dropout, and a resumed run, which restores its data position, drops the same samples.
A clip decoded from the media gets the empty prompt, which the pipeline's prompt unit encodes; a latent-cache
entry gets the empty prompt's embedding that the cache stores once (``CachedLatentDataset.empty_context``), so
both paths train the same objective. Validation keeps every caption.
"""

from __future__ import annotations

from diffsynth_mbc.data.caption_rules import EMPTY_PROMPT, dropped


class CaptionDropout:
    def __init__(self, probability: float, seed: int, rank: int, dataset=None, status=None):
        self.probability, self.seed, self.rank = probability, seed, rank
        self.dataset = dataset   # CachedLatentDataset (its empty_context), or the media dataset
        self.status = status     # RankStatusWriter: ``captions_dropped`` in the rank's status file
        self.dropped = 0         # samples this process trained on the empty prompt (since it started)

    @classmethod
    def from_options(cls, options, rank: int, dataset, status=None) -> "CaptionDropout":
        return cls(options.caption_dropout, options.seed, rank, dataset, status)

    def apply(self, batch: list[dict], epoch: int, batch_in_epoch: int) -> int:
        """Empties the prompt of the dropped samples of ``batch`` in place; how many were dropped."""
        if not self.probability:
            return 0
        count = 0
        for place, sample in enumerate(batch):
            if not dropped(self.probability, self.seed, self.rank, epoch, batch_in_epoch, place):
                continue
            sample["prompt"] = EMPTY_PROMPT
            if sample.get("cached"):
                sample["context"] = self.dataset.empty_context()
            count += 1
        self.dropped += count
        if count and self.status is not None:
            self.status.update(captions_dropped=self.dropped)
        return count
