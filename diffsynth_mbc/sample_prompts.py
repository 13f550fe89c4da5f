"""Sample prompts (``--sample_prompts FILE``) and when and where samples are written. Pure logic, no torch.

The file is YAML (a list of entries, or ``{prompts: [...]}``) or JSON lines (one entry per line). Each
entry: ``prompt`` (required), optional ``image`` (the TI2V first frame, relative to the file's folder),
``seed``, ``height``, ``width``, ``num_frames``, ``steps``, ``cfg_scale``, ``negative_prompt``. Sizes
default to the training's; a bad entry is refused naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path

from diffsynth_mbc.errors import OptionsError, clipped
from diffsynth_mbc.yaml_input import parse_yaml

DEFAULT_STEPS = 30
DEFAULT_CFG = 5.0
BASE_SUFFIX = "-base"           # 01-a-news-anchor-base.mp4
EMA_SUFFIX = "-ema"             # rendered with the EMA of the LoRA: 01-a-news-anchor-ema.mp4
MAX_STRENGTH = 10.0             # --sample_strengths: |s| at most this, with at most STRENGTH_DECIMALS decimals
STRENGTH_DECIMALS = 3
_STRENGTH_SUFFIX = re.compile(r"-s(-?[0-9]{1,2}(?:\.[0-9]{1,3})?)")


@dataclasses.dataclass(frozen=True)
class SamplePrompt:
    prompt: str
    seed: int
    height: int
    width: int
    num_frames: int
    steps: int = DEFAULT_STEPS
    cfg_scale: float = DEFAULT_CFG
    negative_prompt: str = ""
    image: str | None = None

    @property
    def mode(self) -> str:
        """What the clip shows: image-to-video from ``image`` (the first frame), else text-to-video."""
        return "i2v" if self.image else "t2v"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {field.name for field in dataclasses.fields(SamplePrompt)}


def _entries(path: Path) -> list:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".jsonl", ".json"):
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except ValueError as exc:
                    raise OptionsError(f"--sample_prompts {path}: line {number} is not JSON ({exc})") from None
        return entries
    data = parse_yaml(text, f"--sample_prompts {path}")   # refuses an alias bomb, naming the file
    if isinstance(data, dict) and "prompts" in data:
        data = data["prompts"]
    if not isinstance(data, list):
        raise OptionsError(f"--sample_prompts {path}: expected a list of prompts (or prompts: [...])")
    return data


def load_sample_prompts(path: str | Path, *, height: int, width: int, num_frames: int, seed: int) -> list[SamplePrompt]:
    path = Path(path)
    try:
        entries = _entries(path)
    except FileNotFoundError:
        raise OptionsError(f"--sample_prompts: file not found: {path}") from None
    prompts = []
    for number, entry in enumerate(entries, 1):
        where = f"--sample_prompts {path}: entry {number}"
        if isinstance(entry, str):
            entry = {"prompt": entry}
        if not isinstance(entry, dict) or not str(entry.get("prompt") or "").strip():
            raise OptionsError(f"{where}: needs a non-empty 'prompt'")
        unknown = sorted(map(str, set(entry) - FIELDS))
        if unknown:
            raise OptionsError(f"{where}: unknown key(s) {clipped(', '.join(unknown))} "
                               f"(known: {', '.join(sorted(FIELDS))})")
        values = {"seed": seed + number - 1, "height": height, "width": width, "num_frames": num_frames, **entry}
        try:
            prompt = SamplePrompt(prompt=str(values["prompt"]), seed=int(values["seed"]), height=int(values["height"]),
                                  width=int(values["width"]), num_frames=int(values["num_frames"]),
                                  steps=int(values.get("steps", DEFAULT_STEPS)),
                                  cfg_scale=float(values.get("cfg_scale", DEFAULT_CFG)),
                                  negative_prompt=str(values.get("negative_prompt") or ""),
                                  image=_image_path(path, values.get("image")))
        except (TypeError, ValueError) as exc:
            raise OptionsError(f"{where}: {exc}") from None
        _check_sizes(prompt, where)
        prompts.append(prompt)
    if not prompts:
        raise OptionsError(f"--sample_prompts {path}: no prompts")
    return prompts


def _image_path(prompts_file: Path, image) -> str | None:
    if not image:
        return None
    candidate = Path(str(image))
    candidate = candidate if candidate.is_absolute() else prompts_file.parent / candidate
    if not candidate.is_file():
        raise ValueError(f"image not found: {candidate}")
    return str(candidate)


def _check_sizes(prompt: SamplePrompt, where: str) -> None:
    if prompt.height % 32 or prompt.width % 32 or prompt.height < 32 or prompt.width < 32:
        raise OptionsError(f"{where}: height and width must be positive multiples of 32, got "
                           f"{prompt.width}x{prompt.height}")
    if prompt.num_frames < 1 or prompt.num_frames % 4 != 1:
        raise OptionsError(f"{where}: num_frames must be 4k+1 (1, 5, 9, ...), got {prompt.num_frames}")
    if prompt.steps < 1:
        raise OptionsError(f"{where}: steps must be at least 1, got {prompt.steps}")


def slug(text: str, limit: int = 40) -> str:
    """A file-name-safe summary of a prompt: its letters and digits, in their own script, joined by '-'.

    Only a summary: the full text is kept in the set's prompts file (``prompts_file_record``).
    """
    words = re.sub(r"[\W_]+", "-", unicodedata.normalize("NFC", text)).strip("-").lower()
    return words[:limit].rstrip("-") or "prompt"


def prompts_file_record(prompts: list[SamplePrompt]) -> dict:
    """What ``run_layout.PROMPTS_FILE`` beside a set's clips holds: each clip's number, file stem and full prompt."""
    return {"prompts": [{"index": index + 1, "stem": sample_file_stem(index, prompt), "mode": prompt.mode,
                         **prompt.as_dict()}
                        for index, prompt in enumerate(prompts)]}


def sample_file_stem(index: int, prompt: SamplePrompt) -> str:
    return f"{index + 1:02d}-{slug(prompt.prompt)}"


def sampling_due(step: int, every: int | None, total_steps: int, *, first_step: int = 0) -> bool:
    """Samples before the first step (a baseline, step 0 of a fresh run), every ``every`` steps, and at the end."""
    if step == 0:
        return first_step == 0
    return step == total_steps or bool(every and step % every == 0)


# ---------------------------------------------------------------------------------------------
# --sample_strengths: the LoRA's strengths each prompt renders at, and the clips' file names


def parse_strengths(value) -> list[float]:
    """``--sample_strengths 0,0.5,1`` -> [0.0, 0.5, 1.0]: ascending, each once; OptionsError naming the flag.

    0 is the base model (no LoRA), 1 the LoRA as trained; values from -10 to 10 with at most 3 decimals (each
    names its clips' files)."""
    text = str(value).strip()
    strengths = []
    for part in text.split(","):
        number = _strength(part.strip())
        if number is None:
            raise OptionsError(f"--sample_strengths must be comma-separated numbers from {-MAX_STRENGTH:g} to "
                               f"{MAX_STRENGTH:g} with at most {STRENGTH_DECIMALS} decimals (0: the base model, 1: "
                               f"the LoRA as trained), e.g. 0,0.5,1; got {clipped(repr(text))}")
        if number in strengths:
            raise OptionsError(f"--sample_strengths names {strength_text(number)} twice ({clipped(repr(text))})")
        strengths.append(number)
    return sorted(strengths)


def _strength(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    if not abs(number) <= MAX_STRENGTH or round(number, STRENGTH_DECIMALS) != number:
        return None
    return number + 0.0   # -0.0 -> 0.0


def strength_text(strength: float) -> str:
    """How a strength is written in file names and labels: 0.5 -> "0.5", 1.0 -> "1", -0.25 -> "-0.25"."""
    text = f"{strength:.{STRENGTH_DECIMALS}f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


def clip_suffix(strength: float, weights: str) -> str:
    """What follows a prompt's stem in a clip's file name. Strength 1 keeps the names clips always had ("" for the
    raw LoRA, "-ema" for its EMA); another strength adds ``-s<strength>`` ("-s0.5", "-s0.5-ema"); strength 0 is the
    base model, the same for either weights: "-base" (in ``samples/base/``)."""
    if strength == 0:
        return BASE_SUFFIX
    return ("" if strength == 1 else f"-s{strength_text(strength)}") + (EMA_SUFFIX if weights == "ema" else "")


def read_clip_suffix(suffix: str) -> tuple[float, str | None] | None:
    """``clip_suffix``'s inverse: (strength, "raw" | "ema"; None for the base model), or None for anything else."""
    if suffix == BASE_SUFFIX:
        return 0.0, None
    weights = "raw"
    if suffix.endswith(EMA_SUFFIX):
        suffix, weights = suffix[:-len(EMA_SUFFIX)], "ema"
    if not suffix:
        return 1.0, weights
    match = _STRENGTH_SUFFIX.fullmatch(suffix)
    strength = _strength(match.group(1)) if match else None
    if strength is None or strength in (0, 1):   # those have names of their own
        return None
    return strength, weights
