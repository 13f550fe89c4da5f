"""Batches of one shape: videos with videos, images with images. Pure Python: no torch, no diffsynth.

A batch goes through the DiT in one forward, so its samples must share a latent shape. Each row has a
shape key (``video`` or ``image`` today; any further resolution or frame-count bucket is just another key),
each key a batch size (``--batch_size`` for videos, ``--image_batch_size`` for images). An epoch's batches:

1. the ``rows x repeat`` sample indices of each key, shuffled (seeded by seed and epoch), cut into batches
   of the key's size (the last batch of a key may be smaller: nothing is dropped);
2. all batches shuffled together (same seed), so videos and images interleave;
3. padded to a multiple of the world size by repeating batches from the start, so every rank runs the same
   number (the sharding gives batch ``i`` to rank ``i % world_size``).

The loader gets each index plus ``epoch x span``, ``span`` the indices one epoch takes (``epoch_span``: rows x
repeat x the largest catalogue repeat): the datasets read row ``index % rows``, and ``sample_place`` gives the epoch
and the sample within it in whichever worker process loads it (a random frame window is drawn per sample: a row's
copies in one epoch and in the next draw apart). The same seed and epoch give the same batches on every rank and on resume. ``batches_per_rank`` counts
them without building them, for the step plan.

**Equal load** (``--buckets aspect``, ``equal_load=True``): keys are media kind and bucket (``video@1280x704``), and
at every position all ranks must train the same key, so no rank waits on another. Each key's shuffled samples are
cut into full batches (the last one filled up with the key's first samples of this epoch), its batches padded to a
multiple of the world size with its own first batches, and dealt in groups of ``world_size``: the groups of all
keys are shuffled together, so batch ``i`` of every rank comes from the same group. The repeated samples are counted
by ``equal_load_repeats`` and said in the step plan.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Mapping, Sequence

from diffsynth_mbc.data.sample_draws import epoch_span


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def default_image_batch_size(video_batch_size: int, num_frames: int) -> int:
    """As many images as ``video_batch_size`` videos have tokens: a video has (frames - 1) / 4 + 1 latent
    frames, an image one, so 5 images per video at 17 frames."""
    return video_batch_size * ((num_frames - 1) // 4 + 1)


def key_batches(keys: Sequence[str], repeat: int, batch_sizes: Mapping[str, int],
                row_repeats: Sequence[int] | None = None) -> dict[str, int]:
    """Batches of each key in one epoch (before padding)."""
    counts = Counter()
    for row, key in enumerate(keys):
        counts[key] += row_repeats[row] if row_repeats else 1
    return {key: _ceil_div(count * repeat, _batch_size(batch_sizes, key)) for key, count in counts.items()}


def batches_per_rank(keys: Sequence[str], repeat: int, batch_sizes: Mapping[str, int], world_size: int,
                     row_repeats: Sequence[int] | None = None, equal_load: bool = False) -> int:
    counts = key_batches(keys, repeat, batch_sizes, row_repeats)
    if equal_load:
        return sum(_ceil_div(batches, world_size) for batches in counts.values())
    return _ceil_div(sum(counts.values()), world_size)


def key_samples(keys: Sequence[str], repeat: int, row_repeats: Sequence[int] | None = None) -> dict[str, int]:
    """Samples of each key in one epoch."""
    counts = Counter()
    for row, key in enumerate(keys):
        counts[key] += (row_repeats[row] if row_repeats else 1) * repeat
    return dict(sorted(counts.items()))


def equal_load_repeats(samples: int, batch_size: int, world_size: int) -> int:
    """Samples a key repeats per epoch under equal load: its last batch filled up, its batches padded to a whole
    group of ``world_size``."""
    groups = _ceil_div(_ceil_div(samples, batch_size), world_size)
    return groups * world_size * batch_size - samples


def _sample_indices(rows: int, repeat: int, row_repeats: Sequence[int] | None):
    """Each row ``repeat`` (x its own repeat, from ``row_repeats``) times: copy ``k`` of row ``r`` is sample
    ``k * rows + r`` (the dataset reads row ``index % rows``). Without ``row_repeats``: ``range(rows * repeat)``."""
    if not row_repeats:
        yield from range(rows * repeat)
        return
    for copy in range(max(row_repeats) * repeat):
        for row in range(rows):
            if copy < row_repeats[row] * repeat:
                yield copy * rows + row


def epoch_batches(keys: Sequence[str], repeat: int, batch_sizes: Mapping[str, int], world_size: int, seed: int,
                  epoch: int, row_repeats: Sequence[int] | None = None, equal_load: bool = False) -> list[list[int]]:
    """Every rank's batches of one epoch, in order (sample indices into ``rows x repeat``), padded to a multiple
    of ``world_size``. ``row_repeats``: each row's own repeat (several catalogues, ``data/dataset_list.py``)."""
    rows = len(keys)
    by_key: dict[str, list[int]] = {}
    for index in _sample_indices(rows, repeat, row_repeats):
        by_key.setdefault(keys[index % rows], []).append(index)
    return _dealt(by_key, batch_sizes, world_size, random.Random(f"mbc-batches:{seed}:{epoch}"), equal_load)


def rest_of_epoch(keys: Sequence[str], repeat: int, batch_sizes: Mapping[str, int], world_size: int, seed: int,
                  epoch: int, row_repeats: Sequence[int] | None, equal_load: bool,
                  before: Sequence[tuple[int, int]]) -> list[list[int]]:
    """What is left of an epoch that other numbers of processes trained part of, dealt over ``world_size`` ranks
    (a resume on another number of GPUs, ``training/plan/elastic.py``). ``before``: each part trained, in order, as
    ``(processes, batches per process)``: the first part's batches are the epoch's as its processes dealt them, each
    later part's the rest of the part before it. Every sample of the epoch not trained yet, once, in the order the
    epoch had them, batched by shape again and padded as any epoch is."""
    rows = len(keys)
    batches = epoch_batches(keys, repeat, batch_sizes, before[0][0], seed, epoch, row_repeats, equal_load)
    trained: set[int] = set()
    for part, (processes, done) in enumerate(before):
        trained.update(index for batch in batches[:done * processes] for index in batch)
        by_key: dict[str, list[int]] = {}
        for index in dict.fromkeys(index for batch in batches[done * processes:] for index in batch):
            if index not in trained:   # padding repeats samples: each goes once
                by_key.setdefault(keys[index % rows], []).append(index)
        dealt_over = before[part + 1][0] if part + 1 < len(before) else world_size
        rng = random.Random(f"mbc-batches:{seed}:{epoch}:rest:{part}:{processes}:{done}")
        batches = _dealt(by_key, batch_sizes, dealt_over, rng, equal_load, shuffle=False)
    return batches


def _dealt(by_key: dict[str, list[int]], batch_sizes: Mapping[str, int], world_size: int, rng: random.Random,
           equal_load: bool, shuffle: bool = True) -> list[list[int]]:
    """Each key's samples (shuffled, unless ``shuffle`` is off) cut into batches of its size, the batches shuffled
    together and padded to a multiple of ``world_size``; under equal load, dealt in groups (module docstring)."""
    if equal_load:
        return _equal_load_batches(by_key, batch_sizes, world_size, rng, shuffle)
    batches = []
    for key in sorted(by_key):
        indices = by_key[key]
        if shuffle:
            rng.shuffle(indices)
        size = _batch_size(batch_sizes, key)
        batches.extend(indices[start:start + size] for start in range(0, len(indices), size))
    rng.shuffle(batches)
    if batches and len(batches) % world_size:
        padding = world_size - len(batches) % world_size
        batches.extend(batches[i % len(batches)] for i in range(padding))
    return batches


def _equal_load_batches(by_key: dict[str, list[int]], batch_sizes: Mapping[str, int], world_size: int,
                        rng: random.Random, shuffle: bool = True) -> list[list[int]]:
    """Groups of ``world_size`` full batches of one key each, the groups shuffled (module docstring)."""
    groups = []
    for key in sorted(by_key):
        indices = by_key[key]
        if shuffle:
            rng.shuffle(indices)
        size = _batch_size(batch_sizes, key)
        filled = indices + [indices[i % len(indices)] for i in range(-len(indices) % size)]
        batches = [filled[start:start + size] for start in range(0, len(filled), size)]
        batches += [batches[i % len(batches)] for i in range(-len(batches) % world_size)]
        groups.extend(batches[start:start + world_size] for start in range(0, len(batches), world_size))
    rng.shuffle(groups)
    return [batch for group in groups for batch in group]


def _batch_size(batch_sizes: Mapping[str, int], key: str) -> int:
    """The batch size of ``key``'s samples: given for the key, else for its media kind (``video@1280x704``:
    ``video``)."""
    try:
        size = int(batch_sizes[key] if key in batch_sizes else batch_sizes[key.partition("@")[0]])
    except KeyError:
        raise ValueError(f"no batch size for samples of shape {key!r} (sizes given: {dict(batch_sizes)})") from None
    if size < 1:
        raise ValueError(f"the batch size of {key!r} must be at least 1, got {size}")
    return size


class ShapeGroupedBatchSampler:
    """A data loader's ``batch_sampler``: ``epoch_batches`` of the current epoch (``set_epoch``), all ranks'
    batches in turn; accelerate's sharding hands batch ``i`` to rank ``i % world_size``."""

    batch_size = None   # batches differ in size: accelerate then shards them whole, one per rank in turn
    drop_last = False

    def __init__(self, keys: Sequence[str], repeat: int, batch_sizes: Mapping[str, int], world_size: int,
                 seed: int, row_repeats: Sequence[int] | None = None, equal_load: bool = False):
        self.keys, self.repeat, self.batch_sizes = list(keys), repeat, dict(batch_sizes)
        self.row_repeats = list(row_repeats) if row_repeats else None
        self.world_size, self.seed, self.epoch = world_size, seed, 0
        self.equal_load = equal_load
        self.epoch_span = epoch_span(len(self.keys), repeat, self.row_repeats)

    stage_of_step = None   # --resolution_stages: optimizer step (0-based) -> its stage (set_stages)
    rest: tuple[int, tuple] | None = None   # (epoch, its parts trained before on other numbers of processes)
    _rest_kept: tuple = (None, None)        # the last rest of an epoch built (batches_of)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_stages(self, stage_of_step, first_step_of_epoch, accumulation: int) -> None:
        """Each index then goes out as ``(index, stage)``: the stage of the optimizer step its batch belongs to, the
        same on every rank (batch ``i`` is rank ``i % world_size``'s ``i // world_size``-th); an epoch's first step
        from ``first_step_of_epoch(epoch)``."""
        self.stage_of_step, self.first_step_of_epoch, self.accumulation = stage_of_step, first_step_of_epoch, \
            accumulation

    def go_on_after(self, epoch: int, before: Sequence[tuple[int, int]]) -> None:
        """``epoch`` was partly trained on other numbers of processes (``before``, as ``rest_of_epoch`` takes it):
        its iteration is then what is left of it, dealt over this sampler's ranks."""
        self.rest = (epoch, tuple(tuple(part) for part in before))

    def batches_of(self, epoch: int, world_size: int | None = None, before: Sequence[tuple[int, int]] = ()):
        """Every rank's batches of ``epoch`` in turn, on ``world_size`` processes (this sampler's by default); the
        rest of it where ``before`` names parts trained before."""
        world_size = world_size or self.world_size
        if before:   # kept: the loader's length asks for it after every step
            key = (epoch, world_size, tuple(before))
            if self._rest_kept[0] != key:
                self._rest_kept = (key, rest_of_epoch(self.keys, self.repeat, self.batch_sizes, world_size, self.seed,
                                                      epoch, self.row_repeats, self.equal_load, before))
            return self._rest_kept[1]
        return epoch_batches(self.keys, self.repeat, self.batch_sizes, world_size, self.seed, epoch,
                             self.row_repeats, self.equal_load)

    def epoch_batches(self) -> list[list[int]]:
        """This epoch's batches, every rank's in turn (what is left of it after a resume on other processes)."""
        return self.batches_of(self.epoch, before=self.before(self.epoch))

    def before(self, epoch: int) -> tuple:
        """The parts of ``epoch`` trained on other numbers of processes before (``go_on_after``); () for most."""
        return self.rest[1] if self.rest is not None and self.rest[0] == epoch else ()

    def rank_batches(self, epoch: int, world_size: int | None = None, before: Sequence[tuple[int, int]] = ()) -> int:
        """Batches per rank of ``epoch`` (of its rest where ``before`` says), on ``world_size`` processes."""
        world_size = world_size or self.world_size
        if before:
            return len(self.batches_of(epoch, world_size, before)) // world_size
        return batches_per_rank(self.keys, self.repeat, self.batch_sizes, world_size, self.row_repeats,
                                self.equal_load)

    def __iter__(self):
        offset = self.epoch * self.epoch_span   # the epoch rides along in the index (module docstring)
        batches = [[index + offset for index in batch] for batch in self.epoch_batches()]
        if self.stage_of_step:
            first = self.first_step_of_epoch(self.epoch)
            steps = [first + position // self.world_size // self.accumulation for position in range(len(batches))]
            batches = [[(index, self.stage_of_step(step)) for index in batch] for step, batch in zip(steps, batches)]
        return iter(batches)

    def __len__(self) -> int:
        return self.rank_batches(self.epoch, before=self.before(self.epoch)) * self.world_size
