"""--timestep_sampling and its parameters from the command line and a preset; bad values name the flag; a resume
with other timestep settings is refused (they change the objective)."""

from __future__ import annotations

import pytest

from diffsynth_mbc.errors import OptionsError
from diffsynth_mbc.training.checkpoints.fingerprint import fingerprint_differences, run_fingerprint
from diffsynth_mbc.training.options import resolve_options

REQUIRED = ["--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv"]


def test_the_default_is_diffsynths_draw_and_weight():
    options = resolve_options(REQUIRED)
    assert (options.timestep_sampling, options.loss_weighting, options.timestep_strata) == ("diffsynth", "diffsynth", 1)


def test_flags_and_dashed_flags_and_a_preset_give_the_same_options(tmp_path):
    flags = resolve_options(REQUIRED + ["--timestep_sampling", "logit_normal", "--logit_mean", "-0.5",
                                        "--logit-std", "0.8", "--timestep_strata", "4", "--loss_weighting", "none"])
    preset = tmp_path / "p.yaml"
    preset.write_text("dataset_base_path: data\ndataset_metadata_path: data/metadata.csv\n"
                      "timestep_sampling: logit_normal\nlogit_mean: -0.5\nlogit_std: '0.8'\ntimestep_strata: 4\n"
                      "loss_weighting: none\n")
    from_file = resolve_options(["--config", str(preset)])
    for key in ("timestep_sampling", "logit_mean", "logit_std", "timestep_strata", "loss_weighting"):
        assert getattr(flags, key) == getattr(from_file, key), key
    assert from_file.logit_std == 0.8 and from_file.timestep_strata == 4


@pytest.mark.parametrize("flags,named", [
    (["--timestep_sampling", "beta"], "--timestep_sampling"),
    (["--loss_weighting", "snr"], "--loss_weighting"),
    (["--timestep_sampling", "shift", "--timestep_shift", "0"], "--timestep_shift"),
    (["--timestep_sampling", "shift", "--timestep_shift", "nan"], "--timestep_shift"),
    (["--timestep_sampling", "logit_normal", "--logit_std", "-1"], "--logit_std"),
    (["--timestep_sampling", "logit_normal", "--logit_mean", "inf"], "--logit_mean"),
    (["--timestep_sampling", "sigmoid", "--sigmoid_scale", "0"], "--sigmoid_scale"),
    (["--timestep_strata", "0"], "--timestep_strata"),
    # a parameter of another scheme would do nothing: said, not ignored
    (["--timestep_shift", "3"], "--timestep_shift 3 applies to --timestep_sampling shift only"),
    (["--timestep_sampling", "uniform", "--logit_mean", "1"], "--logit_mean"),
    (["--timestep_sampling", "logit_normal", "--sigmoid_scale", "2"], "--sigmoid_scale"),
])
def test_bad_timestep_values_name_the_flag(flags, named):
    with pytest.raises(OptionsError, match=named):
        resolve_options(REQUIRED + flags)


def _fingerprint(*flags):
    options = resolve_options(REQUIRED + list(flags))
    return run_fingerprint(options, world_size=2, accumulation=1, rows=10, metadata_sha256="x", image_batch=5,
                           precision="bf16")


def test_a_resume_with_other_timestep_settings_is_told_apart():
    saved = _fingerprint()
    assert fingerprint_differences(saved, _fingerprint()) == []
    differences = fingerprint_differences(saved, _fingerprint("--timestep_sampling", "sigmoid", "--sigmoid_scale", "2"))
    assert len(differences) == 1 and differences[0].startswith("timestep_sampling: checkpoint {")
    assert "'sigmoid_scale': 2.0" in differences[0]
    assert fingerprint_differences(saved, _fingerprint("--loss_weighting", "none"))
    assert fingerprint_differences(saved, _fingerprint("--timestep_strata", "2"))
    older = {key: value for key, value in saved.items() if key != "timestep_sampling"}   # saved before it was kept
    assert fingerprint_differences(older, _fingerprint("--loss_weighting", "none")) == []
