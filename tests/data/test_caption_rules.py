"""--caption_dropout, --caption_prefix, --caption_suffix: the pure rules and the options (no torch)."""

import pytest

from diffsynth_mbc.data.caption_rules import draw, dropped, with_affixes
from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan.command import cache_arguments


def options(*flags):
    return resolve_options(["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv", *flags])


def test_affixes_join_with_one_space_and_leave_the_caption_alone_without_them():
    caption = "  an anchor speaks,\nthe camera moves in  "
    assert with_affixes(caption) is caption and with_affixes(caption, "", "") is caption
    assert with_affixes("a clip", "mbcstyle") == "mbcstyle a clip"
    assert with_affixes("a clip", "", "in mbc style") == "a clip in mbc style"
    assert with_affixes("a clip", "mbcstyle,", "(archive)") == "mbcstyle, a clip (archive)"


def test_dropout_is_a_function_of_seed_rank_epoch_and_place_at_the_asked_rate():
    places = [(rank, epoch, batch, place) for rank in range(2) for epoch in range(3) for batch in range(500)
              for place in range(2)]
    first = [dropped(0.3, 42, *where) for where in places]
    assert first == [dropped(0.3, 42, *where) for where in places]            # the same on every call (resume)
    assert sum(first) / len(first) == pytest.approx(0.3, abs=0.02)
    assert first != [dropped(0.3, 43, *where) for where in places]            # another seed, other samples
    rank0 = [dropped(0.3, 42, 0, 0, batch, 0) for batch in range(500)]
    assert rank0 != [dropped(0.3, 42, 1, 0, batch, 0) for batch in range(500)]   # ranks differ
    assert rank0 != [dropped(0.3, 42, 0, 1, batch, 0) for batch in range(500)]   # epochs differ
    assert not any(dropped(0.0, 42, *where) for where in places)
    assert all(dropped(1.0, 42, *where) for where in places)
    assert all(0 <= draw(42, *where) < 1 for where in places[:100])


def test_options_default_to_no_change_and_reject_bad_values_naming_the_flag(tmp_path):
    defaults = options()
    assert (defaults.caption_dropout, defaults.caption_prefix, defaults.caption_suffix) == (0.0, "", "")
    given = options("--caption_dropout", "0.1", "--caption-prefix", "mbcstyle", "--caption_suffix", "(archive)")
    assert (given.caption_dropout, given.caption_prefix, given.caption_suffix) == (0.1, "mbcstyle", "(archive)")
    for value in ("1.5", "-0.1", "nan"):
        with pytest.raises(OptionsError, match=r"--caption_dropout must be a finite number between 0 and 1"):
            options("--caption_dropout", value)
    with pytest.raises(OptionsError, match=r"--caption_prefix must be one line without leading or trailing spaces"):
        options("--caption_prefix", "mbcstyle ")
    preset = tmp_path / "preset.yaml"
    preset.write_text("caption_dropout: 0.05\ncaption_suffix: in mbc style\n")
    from_file = options("--config", str(preset))
    assert (from_file.caption_dropout, from_file.caption_suffix) == (0.05, "in mbc style")
    preset.write_text("caption_prefix: 1234\n")
    with pytest.raises(OptionsError, match=r"--caption_prefix must be text, got 1234 \(quote it"):
        options("--config", str(preset))


def test_a_resume_with_other_caption_settings_is_named_and_the_cache_command_gets_the_affixes():
    def fingerprint(*flags):
        return run_fingerprint(options(*flags), world_size=2, accumulation=1, rows=3, metadata_sha256="abc",
                               image_batch=5, precision="no")
    saved = fingerprint("--caption_dropout", "0.1", "--caption_prefix", "mbcstyle")
    assert fingerprint_differences(saved, fingerprint("--caption_dropout", "0.1", "--caption_prefix", "mbcstyle")) == []
    assert fingerprint_differences(saved, fingerprint()) == [
        "caption_dropout: checkpoint 0.1, this run 0.0", "caption_prefix: checkpoint 'mbcstyle', this run ''"]
    arguments = cache_arguments(options("--demo", "--caption_prefix", "mbcstyle"), "m.csv", "data", "cache")
    assert arguments[arguments.index("--caption_prefix") + 1] == "mbcstyle" and "--caption_suffix" not in arguments
    assert "--caption_prefix" not in cache_arguments(options("--demo"), "m.csv", "data", "cache")
