"""The run's recipe (the settings that change what is trained), each catalogue's samples this epoch, and what the
end summary says against the base model and of the files the run wrote. Pure: no torch, no run."""

from __future__ import annotations

import json

from catalog_helpers import COMBINED, clip, write_metadata
from diffsynth_mbc.data.dataset_list import Catalogue, DatasetCount
from diffsynth_mbc.training.options.run_options import TrainOptions
from diffsynth_mbc.training.plan.step_plan import StepPlan
from diffsynth_mbc.training.reporting.catalogue_progress import CatalogueProgress, catalogues_text
from diffsynth_mbc.training.reporting.recipe import recipe_lines, recipe_of
from diffsynth_mbc.training.reporting.run_summary import against_base, files_lines, validation_event
from diffsynth_mbc.training.reporting.terminal import progress_line, summary_lines

SEVERAL = dict(datasets=[Catalogue("news", "news", "news/metadata.csv"),
                         Catalogue("drama", "drama", "drama/metadata.csv", 2, "mbc drama, ", "video")],
               dataset_repeat=3, dataset_metadata_path="out/datasets/metadata.csv")


def test_the_recipe_holds_what_changes_what_is_trained():
    options = TrainOptions(**SEVERAL, objective="modes", i2v_probability=0.5, buckets="aspect",
                           timestep_sampling="logit_normal", logit_mean=0.2, logit_std=0.8, timestep_strata=4,
                           loss_weighting="none", lora_variant="dora", lora_rank=16, loraplus_lr_ratio=16.0,
                           ema_decay=0.999, validate_with="both", caption_dropout=0.1, caption_prefix="mbcstyle, ",
                           frame_sampling="uniform", source_fps=8.0, short_clips="loop", learning_rate=2e-4)
    recipe = recipe_of(options)
    assert recipe["objective"] == "modes" and recipe["i2v_probability"] == 0.5 and recipe["buckets"] == "aspect"
    assert recipe["timestep_sampling"] == {"method": "logit_normal", "logit_mean": 0.2, "logit_std": 0.8, "strata": 4}
    assert recipe["loss_weighting"] == "none"
    assert recipe["lora"] == {"variant": "dora", "rank": 16, "alpha": 16, "target_modules": "q,k,v,o,ffn.0,ffn.2",
                              "loraplus_lr_ratio": 16.0, "init_lora": None}
    assert recipe["ema"] == {"decay": 0.999, "warmup": True, "validate_with": "both"}
    assert recipe["captions"] == {"dropout": 0.1, "prefix": "mbcstyle, ", "suffix": ""}
    assert recipe["frames"] == {"sampling": "uniform", "source_fps": 8.0, "short_clips": "loop"}
    assert recipe["catalogues"] == [   # each one's repeat per epoch: its own x --dataset_repeat
        {"name": "news", "metadata_path": "news/metadata.csv", "repeat": 3},
        {"name": "drama", "metadata_path": "drama/metadata.csv", "repeat": 6, "caption_prefix": "mbc drama, ",
         "media": "video"}]
    json.dumps(recipe)   # it goes into the status file as it is
    lines = recipe_lines(recipe)
    assert lines[0].startswith("recipe: objective modes (videos i2v 50%)") and all(len(line) <= 80 for line in lines)
    assert all(line.startswith("  ") for line in lines[1:])
    text = " ".join(line.strip() for line in lines)
    for said in ("buckets aspect", "frames uniform at 8 fps, short clips loop",
                 "timesteps logit_normal logit_mean 0.2 logit_std 0.8 strata 4", "loss weighting none",
                 "dora rank 16 alpha 16 LoRA+ x16", "EMA 0.999 (validate with both)",
                 "caption dropout 0.1, prefix 'mbcstyle, '", "catalogues news x3, drama x6"):
        assert said in text, said


def test_a_default_run_s_recipe_names_its_one_catalogue_and_the_defaults():
    recipe = recipe_of(TrainOptions(dataset_metadata_path="runs/demo/metadata/metadata.csv", dataset_repeat=3))
    assert recipe == {   # as the status file has carried it (the monitor and dashboard read it)
        "objective": "modes", "i2v_probability": 1.0, "size": {"height": 704, "width": 1280, "num_frames": 17},
        "buckets": "off", "frames": {"sampling": "head", "source_fps": None, "short_clips": "shorten"},
        "timestep_sampling": {"method": "diffsynth"}, "loss_weighting": "diffsynth",
        "lora": {"variant": "lora", "rank": 32, "alpha": 32, "target_modules": "q,k,v,o,ffn.0,ffn.2",
                 "loraplus_lr_ratio": None, "init_lora": None},
        "learning_rate": 0.0001, "lr_scheduler": "constant", "ema": None,
        "captions": {"dropout": 0.0, "prefix": "", "suffix": ""},
        "catalogues": [{"name": "metadata", "metadata_path": "runs/demo/metadata/metadata.csv", "repeat": 3}]}
    assert recipe["timestep_sampling"] == {"method": "diffsynth"} and recipe["ema"] is None
    assert recipe["catalogues"] == [{"name": "metadata", "metadata_path": "runs/demo/metadata/metadata.csv",
                                     "repeat": 3}]
    assert recipe["lora"]["alpha"] == 32   # no --lora_alpha: the rank
    assert "no EMA | caption dropout 0" in " ".join(recipe_lines(recipe))


def test_each_catalogue_s_samples_this_epoch_are_counted_and_reset(tmp_path):
    metadata = write_metadata(tmp_path / "metadata.csv", [
        clip(f"{row}.mp4", caption="a", dataset=position) for row, position in enumerate([0, 0, 1, 1, 1])], COMBINED)
    plan = StepPlan(rows=5, repeat=3, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=1,
                    datasets=(DatasetCount("news", 2, 0, 1), DatasetCount("drama", 3, 0, 2)))
    options = TrainOptions(**{**SEVERAL, "dataset_metadata_path": str(metadata)})
    progress = CatalogueProgress.from_run(options, plan, world_size=2)
    progress.count([{"row": 1}, {"row": 3}])
    progress.count([{"row": 5}, {"row": "-"}])   # a row that names no metadata row counts for none
    # per_epoch: each catalogue's rows x its repeat x --dataset_repeat, this rank's share of 2 ranks
    assert progress.as_list() == [{"name": "news", "seen": 1, "per_epoch": 3},
                                  {"name": "drama", "seen": 2, "per_epoch": 9}]
    assert catalogues_text(progress.as_list()) == "news 1/~3, drama 2/~9"
    state = {"step": 2, "total_steps": 8, "catalogue_progress": progress.as_list()}
    assert progress_line(state).endswith("| ETA - | seen: news 1/~3, drama 2/~9")
    progress.reset()
    assert [item["seen"] for item in progress.as_list()] == [0, 0]
    one = TrainOptions(datasets=[Catalogue("news", "news", "news/metadata.csv")], dataset_metadata_path=str(metadata))
    single = StepPlan(rows=5, repeat=1, world_size=2, batch_size=1, gradient_accumulation=1, num_epochs=1,
                      datasets=(DatasetCount("news", 5, 0, 1),))
    assert CatalogueProgress.from_run(one, single, 2) is None and catalogues_text([{"name": "x"}]) == ""
    assert "seen" not in progress_line({"step": 2, "total_steps": 8})


def write_lora_file(path, run_id):
    header = json.dumps({"__metadata__": {"run_id": run_id}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header)


def test_the_summary_says_the_gain_over_the_base_model_and_every_file_the_run_wrote(tmp_path):
    assert against_base(0.4123, 0.4410) == "0.4123 vs the base model's 0.4410 (LoRA gain 0.0287, 6.5%)"
    for name in ("lora", "lora_ema", "epoch-001", "epoch-001_ema", "epoch-002", "epoch-002_ema", "step-4",
                 "step-4_ema"):
        write_lora_file(tmp_path / f"{name}.safetensors", "run-x")
    write_lora_file(tmp_path / "step-2.safetensors", "another-run")   # not this run's: not listed
    state = {"status": "finished", "step": 12, "total_steps": 12, "run_id": "run-x", "val_loss": 0.4123,
             "val_step": 12, "val_loss_base": 0.4410, "val_loss_ema": 0.4200, "val_loss_base_step": 3}
    lines = summary_lines(state, output_path=str(tmp_path), log_dir="logs", best_val_loss=0.41)
    assert lines[1].startswith("  validation loss: last 0.4123 at step 12")
    assert lines[2] == "  validation: loss 0.4123 vs the base model's 0.4410 (LoRA gain 0.0287, 6.5%)"
    assert lines[3] == "  validation: EMA loss 0.4200 vs the base model's 0.4410 (LoRA gain 0.0210, 4.8%)"
    assert lines[4] == f"  LoRA: {tmp_path}/lora.safetensors"
    assert lines[5] == f"  EMA LoRA: {tmp_path}/lora_ema.safetensors"
    assert lines[6] == (f"  also in {tmp_path}: 2 epoch file(s) (epoch-001 .. epoch-002), 1 step file(s) (step-4) "
                        "(each with its _ema twin)")
    assert files_lines(str(tmp_path), "a-third-run") == [] and files_lines(str(tmp_path / "none"), "run-x") == []
    worse = summary_lines({**state, "val_loss": 0.45, "val_loss_ema": None, "val_weights": "ema"},
                          output_path=str(tmp_path), log_dir="logs", best_val_loss=0.45)
    assert "  validation: loss (EMA) 0.4500 vs the base model's 0.4410 (LoRA gain -0.0090, -2.0%)" in worse
    assert validation_event(state, " (1.0 s)") == ("validation at step 12: val_loss 0.4123 (1.0 s), EMA 0.4200; "
                                                    "base model 0.4410")
    assert validation_event({**state, "val_step": 3}).endswith("base model 0.4410 (measured now, once for the run)")
