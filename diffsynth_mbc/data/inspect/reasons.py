"""What --inspect can flag, in the order it reports them, and ``--exclude``'s reading of them. Pure Python, no
imports: the converter's parser reads these without loading the inspection (numpy, PIL) on every conversion."""

from __future__ import annotations

REASONS = ("scene_cut", "black", "frozen", "letterbox", "pillarbox", "duplicate")


def parse_exclude(text: str | None) -> tuple[str, ...]:
    """``--exclude``: ``all`` or a comma list of REASONS; ValueError naming an unknown one."""
    if text is None:
        return ()
    names = [name.strip() for name in text.split(",") if name.strip()]
    if names == ["all"]:
        return REASONS
    unknown = [name for name in names if name not in REASONS]
    if unknown or not names:
        raise ValueError(f"--exclude {text}: {', '.join(unknown) or 'no reason'} is not one of "
                         f"{', '.join(REASONS)} (or all)")
    return tuple(name for name in REASONS if name in names)
