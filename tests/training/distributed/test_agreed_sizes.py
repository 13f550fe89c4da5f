"""Rank 0's sizes on every rank: a failure on rank 0 stops every rank with its message, and ranks whose metadata
rows differ from rank 0's are refused in one message naming the ranks and rows."""

import pytest

from diffsynth_mbc.data.media.size_table import first_rank_reads
from diffsynth_mbc.errors import MetadataError
from diffsynth_mbc.training.distributed.agreed_sizes import metadata_difference, ranks_disagree


class Wire:
    """What one broadcast carries from rank 0 to the others (torch.distributed's broadcast_object_list does it
    between processes; the 2-rank runs in tests/training/test_size_agreement_run.py)."""

    def __init__(self):
        self.sent = None

    def from_rank_0(self, value):
        self.sent = value
        return value

    def to_others(self, _):
        return self.sent


def test_rank_0s_sizes_reach_every_rank_and_its_refusal_stops_them_all():
    wire = Wire()
    assert first_rank_reads(lambda: [(64, 48)], True, wire.from_rank_0) == [(64, 48)]
    assert first_rank_reads(lambda: pytest.fail("only rank 0 reads"), False, wire.to_others) == [(64, 48)]

    def refused():
        raise MetadataError("metadata row 2 (b.mp4): the columns say 180x320, the file is 320x180")
    with pytest.raises(MetadataError, match="^metadata row 2"):
        first_rank_reads(refused, True, wire.from_rank_0)
    with pytest.raises(MetadataError, match=r"^rank 0 stopped reading the media sizes: metadata row 2 \(b\.mp4\)"):
        first_rank_reads(refused, False, wire.to_others)
    with pytest.raises(OSError):
        first_rank_reads(lambda: open("/nonexistent/metadata.csv"), True, wire.from_rank_0)
    with pytest.raises(RuntimeError, match=r"^rank 0 stopped reading the media sizes: \[Errno 2\] No such file"):
        first_rank_reads(None, False, wire.to_others)


def test_ranks_whose_metadata_differs_are_named_with_their_rows():
    main = [f"clip_{index}.mp4" for index in range(6)]
    assert metadata_difference(list(main), main) is None
    assert metadata_difference(main[:5], main) == "5 rows, rank 0 6"
    other = ["x.mp4" if index in (1, 2, 3, 5) else name for index, name in enumerate(main)]
    assert metadata_difference(other, main) == ("row 2 (x.mp4; rank 0: clip_1.mp4), row 3 (x.mp4; rank 0: clip_2.mp4), "
                                                "row 4 (x.mp4; rank 0: clip_3.mp4) and 1 more")
    assert ranks_disagree([None, None], "m.csv") is None
    assert ranks_disagree([None, "5 rows, rank 0 6"], "m.csv") == (
        "the ranks read different metadata rows from m.csv (rank 1: 5 rows, rank 0 6): every node must read the same "
        "metadata file and media (copy the same files to every node, or share one folder)")
