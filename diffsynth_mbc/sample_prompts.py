"""Sample prompts (``--sample_prompts FILE``) and when and where samples are written. Pure logic, no torch.

The file is YAML (a list of entries, or ``{prompts: [...]}``) or JSON lines (one entry per line), in UTF-8. Each
entry: ``prompt`` (required), optional ``image`` (the TI2V first frame, relative to the file's folder),
``seed``, ``height``, ``width``, ``num_frames``, ``steps``, ``cfg_scale``, ``negative_prompt``. Sizes
default to the training's. Every field is checked when the file is read, before any model loads (the training's
``--sample_prompts`` and ``python -m diffsynth_mbc.sample`` alike): a text where text belongs, whole numbers in
range, a finite ``cfg_scale``, an ``image`` that is a picture file PIL decodes; a bad entry is refused naming the
file, the entry and the field.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from pathlib import Path

from diffsynth_mbc.errors import OptionsError, clipped, quoted
from diffsynth_mbc.values import finite_number
from diffsynth_mbc.yaml_input import parse_yaml

DEFAULT_STEPS = 30
DEFAULT_CFG = 5.0
BASE_SUFFIX = "-base"           # 01-a-news-anchor-base.mp4
EMA_SUFFIX = "-ema"             # rendered with the EMA of the LoRA: 01-a-news-anchor-ema.mp4
MAX_STRENGTH = 10.0             # --sample_strengths: |s| at most this, with at most STRENGTH_DECIMALS decimals
STRENGTH_DECIMALS = 3
STRENGTHS_FLAG = "--sample_strengths"
PROMPTS_FLAG = "--sample_prompts"
MAX_SIDE = 4096                 # pixels, each side: of a sample, and of the training (training/options/checks.py)
MAX_FRAMES = 257                # 16 s at the 16 fps the sample clips are written at
MAX_STEPS = 1000                # denoising steps: the scheduler has 1000 timesteps, more would repeat them
MAX_CFG = 100.0                 # cfg_scale from 0 to this (1: no guidance)
MAX_SEED = 2**64 - 1            # the most torch's random generator takes
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


def _entries(path: Path, source: str) -> list:
    if not path.exists():
        raise OptionsError(f"{source}: file not found: {path}")
    if not path.is_file():   # a folder, or a FIFO that reading would wait on for ever
        raise OptionsError(f"{source} {path}: {'a folder' if path.is_dir() else 'not a regular file'}, not a prompts "
                           "file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OptionsError(f"{source} {path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at position "
                           f"{exc.start}); save it as UTF-8") from None
    except OSError as exc:
        raise OptionsError(f"{source} {path}: cannot be read ({exc.strerror or exc})") from None
    if path.suffix.lower() in (".jsonl", ".json"):
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except ValueError as exc:
                    raise OptionsError(f"{source} {path}: line {number} is not JSON ({exc})") from None
        return entries
    data = parse_yaml(text, f"{source} {path}")   # refuses an alias bomb, naming the file
    if isinstance(data, dict) and "prompts" in data:
        data = data["prompts"]
    if not isinstance(data, list):
        raise OptionsError(f"{source} {path}: expected a list of prompts (or prompts: [...])")
    return data


def load_sample_prompts(path: str | Path, *, height: int, width: int, num_frames: int, seed: int,
                        source: str = PROMPTS_FLAG) -> list[SamplePrompt]:
    """Every entry of the prompts file at ``path``, each field checked; OptionsError naming ``source`` (the flag or
    argument that gave the file), the file and the entry. The sizes and ``seed`` (the first entry's; the next
    entries count on from it) are the defaults."""
    path = Path(path)
    entries = _entries(path, source)
    prompts = []
    for number, entry in enumerate(entries, 1):
        where = f"{source} {path}: entry {number}"
        if isinstance(entry, str):
            entry = {"prompt": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
            raise OptionsError(f"{where}: needs a non-empty 'prompt' (text)")
        unknown = sorted(map(str, set(entry) - FIELDS))
        if unknown:
            raise OptionsError(f"{where}: unknown key(s) {clipped(', '.join(unknown))} "
                               f"(known: {', '.join(sorted(FIELDS))})")
        defaults = {"seed": seed + number - 1, "height": height, "width": width, "num_frames": num_frames,
                    "steps": DEFAULT_STEPS, "cfg_scale": DEFAULT_CFG}
        prompts.append(_checked(path, {**defaults, **entry}, where))
    if not prompts:
        raise OptionsError(f"{source} {path}: no prompts")
    return prompts


def run_sample_prompts(options) -> list[SamplePrompt]:
    """A training run's ``--sample_prompts``, its size and seed the defaults: what it samples, read before the model
    loads (``training/cli.py``) so that a bad entry costs no model load."""
    return load_sample_prompts(options.sample_prompts, height=options.height, width=options.width,
                               num_frames=options.num_frames, seed=options.seed)


def _checked(prompts_file: Path, values: dict, where: str) -> SamplePrompt:
    """The entry's ``values`` as a SamplePrompt, every field checked (OptionsError naming ``where`` and the field)."""
    numbers = {}
    for key, low, high in (("seed", 0, MAX_SEED), ("height", 32, MAX_SIDE), ("width", 32, MAX_SIDE),
                           ("num_frames", 1, MAX_FRAMES), ("steps", 1, MAX_STEPS)):
        number = _whole(values[key])
        if number is None or not low <= number <= high:
            raise OptionsError(f"{where}: {key} must be a whole number from {low:,} to {high:,}, got "
                               f"{quoted(values[key])}")
        numbers[key] = number
    if numbers["height"] % 32 or numbers["width"] % 32:
        raise OptionsError(f"{where}: height and width must be multiples of 32 (the Wan2.2 VAE x DiT patch), got "
                           f"{numbers['width']}x{numbers['height']}")
    if numbers["num_frames"] % 4 != 1:
        raise OptionsError(f"{where}: num_frames must be 4k+1 (1, 5, 9, ...), got {numbers['num_frames']}")
    cfg_scale = finite_number(values["cfg_scale"], text=True)
    if cfg_scale is None or not 0 <= cfg_scale <= MAX_CFG:
        raise OptionsError(f"{where}: cfg_scale must be a finite number from 0 to {MAX_CFG:g} (1: no guidance), got "
                           f"{quoted(values['cfg_scale'])}")
    negative = values.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise OptionsError(f"{where}: negative_prompt must be text, got {quoted(negative)}")
    return SamplePrompt(prompt=values["prompt"], cfg_scale=cfg_scale, negative_prompt=negative or "",
                        image=_image_path(prompts_file, values.get("image"), where), **numbers)


def _whole(value) -> int | None:
    """``value`` as an int when it is a whole number (an int, a float without a fraction, or digits as text)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]{1,40}\s*", value):
        return int(value)
    return None


def _image_path(prompts_file: Path, image, where: str) -> str | None:
    """The first frame's path (relative to the prompts file's folder), once PIL has decoded it."""
    if image is None or image == "":
        return None
    if not isinstance(image, str):
        raise OptionsError(f"{where}: image must be a file name, got {quoted(image)}")
    candidate = Path(image)
    candidate = candidate if candidate.is_absolute() else prompts_file.parent / candidate
    if not candidate.exists():
        raise OptionsError(f"{where}: image not found: {candidate}")
    if not candidate.is_file():   # a FIFO would make the decode below wait for ever
        raise OptionsError(f"{where}: image {candidate} is {'a folder' if candidate.is_dir() else 'not a regular file'}"
                           ", not a picture file")
    from PIL import Image

    try:
        with Image.open(candidate) as picture:
            picture.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise OptionsError(f"{where}: image {candidate} cannot be read as a picture ({exc})") from None
    return str(candidate)


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


def parse_strengths(value, flag: str = STRENGTHS_FLAG) -> list[float]:
    """``--sample_strengths 0,0.5,1`` -> [0.0, 0.5, 1.0]: ascending, each once; OptionsError naming ``flag``.

    0 is the base model (no LoRA), 1 the LoRA as trained; values from -10 to 10 with at most 3 decimals (each
    names its clips' files)."""
    text = str(value).strip()
    strengths = []
    for part in text.split(","):
        number = _strength(part.strip())
        if number is None:
            raise OptionsError(f"{flag} must be comma-separated numbers from {-MAX_STRENGTH:g} to "
                               f"{MAX_STRENGTH:g} with at most {STRENGTH_DECIMALS} decimals (0: the base model, 1: "
                               f"the LoRA as trained), e.g. 0,0.5,1; got {clipped(repr(text))}")
        if number in strengths:
            raise OptionsError(f"{flag} names {strength_text(number)} twice ({clipped(repr(text))})")
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
