"""Which samples may share a batch: a row's shape key. Pure Python.

A batch goes through the DiT in one forward, so its samples must have one latent shape. At one training
size every video has the same shape and every image another, so the key is the media type (from the
metadata's ``media_type``, else the file's extension).
"""

from __future__ import annotations

VIDEO, IMAGE = "video", "image"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")


def shape_key(media_type: str | None, file_name: str | None = None) -> str:
    """``video`` or ``image``: from the metadata's media_type, else from the file's extension."""
    kind = str(media_type or "").strip().lower()
    if kind in (VIDEO, IMAGE):
        return kind
    return IMAGE if str(file_name or "").lower().endswith(IMAGE_EXTENSIONS) else VIDEO
