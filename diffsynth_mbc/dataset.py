"""The MBC dataset adapter: DiffSynth's own VideoDataset over the converter's metadata.

One file column (``video``) holds videos and images (images load as 1-frame clips). A file that
cannot be decoded raises MediaDecodeError naming the metadata row and the file, instead of an
anonymous decoder error (or DiffSynth's silent ``None`` for an unknown extension).
"""

from __future__ import annotations

from diffsynth.trainers.utils import VideoDataset


class MediaDecodeError(RuntimeError):
    pass


class MBCVideoDataset(VideoDataset):
    def __init__(self, base_path: str, metadata_path: str, num_frames: int, height: int, width: int,
                 repeat: int = 1):
        super().__init__(base_path=base_path, metadata_path=metadata_path, num_frames=num_frames,
                         height=height, width=width, data_file_keys=("video",), repeat=repeat)

    @property
    def rows(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        row = index % len(self.data)
        file_name = self.data[row].get("video")
        try:
            sample = super().__getitem__(index)
        except Exception as exc:
            raise MediaDecodeError(f"metadata row {row + 1} ({file_name}): cannot decode: "
                                   f"{type(exc).__name__}: {exc}") from exc
        if sample is None:
            raise MediaDecodeError(f"metadata row {row + 1} ({file_name}): not a video or image extension "
                                   "DiffSynth can load")
        return sample
