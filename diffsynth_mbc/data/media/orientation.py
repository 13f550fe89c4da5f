"""One rule for an image's rotation everywhere: its EXIF orientation applied. What the converter's probe reports,
what the buckets are chosen by, what trains, what the inspection measures and the contact sheet shows, and a sample
prompt's first frame are all the upright picture (a phone photo stored 320x160 with orientation 6 is 160x320).
"""

from __future__ import annotations

EXIF_ORIENTATION = 0x0112
TURNED_ORIENTATIONS = (5, 6, 7, 8)   # EXIF orientations that swap width and height


def orientation(image) -> int:
    """The image's EXIF orientation (1: as stored), read from an EXIF block its header holds (a JPEG's, a PNG's
    before the pixels): never by decoding the pixels, which PIL does to find a later one, and which would leave a
    broken file looking decoded."""
    if "exif" not in getattr(image, "info", {}):
        return 1
    try:
        value = image.getexif().get(EXIF_ORIENTATION, 1)
    except (OSError, ValueError, SyntaxError):   # an unreadable EXIF block: the picture as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def is_turned(image) -> bool:
    """Whether the image's EXIF orientation swaps its stored width and height."""
    return orientation(image) in TURNED_ORIENTATIONS


def displayed_size(image) -> tuple[int, int]:
    """(width, height) of the upright picture, from the header alone."""
    return image.size[::-1] if is_turned(image) else image.size


def upright(image):
    """The picture with its EXIF orientation applied: a new, decoded image when it turns, else the same one. A
    decoding error is the caller's to see (nothing here catches it: PIL would hand back half-decoded pixels)."""
    if orientation(image) == 1:
        return image
    from PIL import ImageOps

    return ImageOps.exif_transpose(image)
