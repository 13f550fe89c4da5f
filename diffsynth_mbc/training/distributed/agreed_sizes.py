"""One set of row sizes for every rank (``--buckets aspect``): rank 0 reads them (the run's size table, each file's
header read once per run) and every rank takes rank 0's, so the ranks plan the same buckets, totals and shapes even
when a file changes during start-up or differs between nodes. A rank whose metadata lists other files than rank 0's
stops, and every rank with it, with one message naming the rows."""

from __future__ import annotations

from diffsynth_mbc.data.media.row_buckets import row_sizes
from diffsynth_mbc.data.media.size_table import first_rank_reads, table_path_in
from diffsynth_mbc.errors import MetadataError
from diffsynth_mbc.training.distributed.collectives import broadcast_from_main, gather_from_all

ROWS_NAMED = 3


def rank_zero_sizes(options, accelerator, status):
    """The training dataset's ``read_sizes``: rows -> every row's size, the same on every rank."""
    table = table_path_in(options.output_path)

    def read_sizes(rows: list[dict]) -> list:
        videos = [str(row.get("video")) for row in rows]
        main_videos, sizes = first_rank_reads(
            lambda: (videos, row_sizes(rows, options.dataset_base_path, table_path=table)),
            accelerator.is_main_process,
            lambda value: broadcast_from_main(accelerator, value, status, "rank 0 reading the media sizes"))
        said = gather_from_all(accelerator, metadata_difference(videos, main_videos), status,
                               "ranks comparing their metadata")
        refusal = ranks_disagree(said, options.dataset_metadata_path)
        if refusal:
            raise MetadataError(refusal)
        return sizes
    return read_sizes


def metadata_difference(mine: list[str], main: list[str]) -> str | None:
    """How this rank's metadata rows differ from rank 0's (their count, else the first rows); None when equal."""
    if len(mine) != len(main):
        return f"{len(mine):,} rows, rank 0 {len(main):,}"
    differing = [number for number, (here, there) in enumerate(zip(mine, main), 1) if here != there]
    if not differing:
        return None
    shown = ", ".join(f"row {number} ({mine[number - 1]}; rank 0: {main[number - 1]})"
                      for number in differing[:ROWS_NAMED])
    more = f" and {len(differing) - ROWS_NAMED:,} more" if len(differing) > ROWS_NAMED else ""
    return f"{shown}{more}"


def ranks_disagree(said: list[str | None], metadata_path: str) -> str | None:
    """One refusal for every rank from what each rank found (``metadata_difference``, in rank order)."""
    differing = [f"rank {rank}: {text}" for rank, text in enumerate(said) if text]
    if not differing:
        return None
    return (f"the ranks read different metadata rows from {metadata_path} ({'; '.join(differing)}): every node "
            "must read the same metadata file and media (copy the same files to every node, or share one folder)")
