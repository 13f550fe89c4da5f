"""What --inspect can flag, in the order it reports them, and ``--exclude``'s reading of them. Pure Python, no
imports: the converter's parser reads these without loading the inspection (numpy, PIL) on every conversion."""

from __future__ import annotations

REASONS = ("scene_cut", "black", "frozen", "letterbox", "pillarbox", "duplicate")


def parse_exclude(text: str | None) -> tuple[str, ...]:
    """``--exclude``: ``all`` or a comma list of REASONS (a name twice counts once; ``all`` among them is every
    reason); ValueError naming each unknown one once."""
    if text is None:
        return ()
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in REASONS and name != "all"]
    if unknown or not names:
        raise ValueError(f"--exclude {text}: {', '.join(unknown) or 'no reason'} "
                         f"{'is' if len(unknown) < 2 else 'are'} not one of {', '.join(REASONS)} (or all)")
    if "all" in names:
        return REASONS
    return tuple(name for name in REASONS if name in names)
