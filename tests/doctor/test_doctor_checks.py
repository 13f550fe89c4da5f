"""What the doctor says besides its figures: how to get the model files, which speed is an assumption, and no
library notice above its output."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from diffsynth_mbc.doctor import checks, report
from diffsynth_mbc.gpu import known_gpu
from diffsynth_mbc.training.options import resolve_options
from diffsynth_mbc.training.plan import estimates
from e2e_helpers import REPO

FULL = str(REPO / "configs" / "train_full.yaml")


def test_a_missing_model_folder_says_how_to_get_the_files(tmp_path):
    options = resolve_options(["--config", FULL, "--model_dir", str(tmp_path / "Wan2.2-TI2V-5B")])
    check = checks.model_check(options)
    assert check.status == checks.FAIL and str(tmp_path / "Wan2.2-TI2V-5B") in check.detail
    assert (f"modelscope download --model Wan-AI/Wan2.2-TI2V-5B --local_dir {tmp_path / 'Wan2.2-TI2V-5B'}"
            in check.fix)
    assert "--model_id Wan-AI/Wan2.2-TI2V-5B" in check.fix

    downloaded_at_start = checks.model_check(resolve_options(["--config", FULL, "--model_dir", "",
                                                                       "--model_id", "Wan-AI/Wan2.2-TI2V-5B"]))
    assert downloaded_at_start.status == checks.WARN
    assert "modelscope download --model Wan-AI/Wan2.2-TI2V-5B --local_dir" in downloaded_at_start.fix


def speed_of(gpu, *flags):
    options = resolve_options(["--config", FULL, *flags])
    return estimates.estimate_run(options, known_gpu(gpu), gpu, "bf16" if gpu != "V100-32GB" else "fp16").speed


def test_an_mfu_worked_out_from_an_estimated_speed_is_labelled_so():
    estimated = report.speed_lines(speed_of("V100-32GB"))[0]
    assert "(estimate;" in estimated and "MFU" in estimated
    assert "if the estimated speed holds" in estimated
    # at 1280x704 (the shape measured on the H100; the preset's --buckets aspect sizes for its largest bucket)
    measured = report.speed_lines(speed_of("H100-80GB", "--cache", "somewhere", "--compile", "on", "--buckets",
                                           "off"))[0]
    assert "(measured;" in measured and "MFU" in measured and "estimated" not in measured


@pytest.mark.slow
def test_no_torch_notice_above_the_doctors_output():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}   # not started by a launcher
    probe = subprocess.run([sys.executable, "-c", "import torch.cuda"], capture_output=True, text=True, timeout=300,
                           env=env)
    if "pynvml" not in probe.stderr:
        pytest.skip("this torch imports no deprecated pynvml here: nothing to silence")
    result = subprocess.run([sys.executable, "-m", "diffsynth_mbc.doctor", "--config", FULL, "--assume", "V100-32GB",
                             "--quick", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert '"checks"' in result.stdout
    assert "pynvml" not in result.stderr and "torch.jit.script" not in result.stderr, result.stderr


def test_without_a_gpu_device_node_the_target_is_found_without_importing_torch(tmp_path, monkeypatch):
    import torch

    assert checks.installed_torch_version() == torch.__version__       # read from torch/version.py
    node = tmp_path / "nvidia0"
    node.touch()
    monkeypatch.setattr(checks, "GPU_DEVICE_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    assert not checks.no_gpu_device()
    monkeypatch.setattr(checks, "GPU_DEVICE_NODES", (str(tmp_path / "kfd"),))
    assert checks.no_gpu_device()
    target = checks.find_target(None, None)
    assert (target.spec, target.count, target.torch_version) == (None, 0, torch.__version__)


@pytest.mark.slow
def test_the_launchers_quick_preflight_imports_no_torch_on_a_machine_without_a_gpu(tmp_path):
    """Every CPU launch runs it: 0.4 s instead of 2.4 s."""
    if not checks.no_gpu_device():
        pytest.skip("this machine has a GPU device node")
    from diffsynth_mbc.data.demo import prepare

    demo = tmp_path / "demo"
    prepare(demo, num_videos=1, num_images=1)
    flags = ["--quick", "--brief", "--detail-file", str(tmp_path / "d.log"), "--config",
             str(REPO / "configs" / "train_demo.yaml"), "--output_path", str(tmp_path / "out"), "--dataset_base_path",
             str(demo / "catalog"), "--dataset_metadata_path", str(demo / "metadata" / "metadata.csv")]
    script = ("import sys; from diffsynth_mbc.doctor.cli import main; "
              f"code = main({flags!r}); print(code, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.stdout.split() == ["0", "False"], result.stderr
    assert "skip: torch kernels: torch " in (tmp_path / "d.log").read_text()


def test_the_frame_rate_check_names_the_rates_and_warns_when_clips_train_off_the_models_24_fps(tmp_path):
    metadata = tmp_path / "metadata.csv"
    metadata.write_text("video,prompt,media_type,fps\n" + "v/a.mp4,a clip,video,29.97\n" * 2
                        + "i/0.png,an image,image,\n")
    preset = ["--config", str(REPO / "configs" / "train_full.yaml"), "--dataset_metadata_path", str(metadata)]
    on_24 = checks.frame_rate_check(resolve_options(preset), (2, 1))
    assert on_24.status == checks.OK and on_24.detail.startswith("clips at 29.97 fps (2) put on the 24 fps timeline")
    own = checks.frame_rate_check(resolve_options([*preset, "--source_fps", "none"]), (2, 1))
    assert own.status == checks.WARN and "train at their own rates" in own.detail
    assert own.fix == "--source_fps 24 (the presets set it)"
    assert checks.frame_rate_check(resolve_options(preset), (0, 1)).status == checks.SKIP
