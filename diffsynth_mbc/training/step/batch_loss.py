"""The training objective over a batch of same-shape samples, in one DiT forward.

Per sample, what ``WanVideoPipeline.training_loss`` does: a timestep drawn from the sample's [min, max)
boundaries, its noise (for a sample conditioned on its first frame, frame 0 is the clean condition),
``scheduler.add_noise``, the flow-matching target, the MSE in fp32 weighted by ``scheduler.training_weight``.
What changes is that the B samples' latents and text embeddings are stacked and go through the DiT once, each
with its own timestep and its own condition flag (the TI2V DiT takes a timestep per token: a conditioned sample's
first-frame tokens get 0, every other token the sample's timestep), that the blocks run through a ``BlockRunner``
(how many recompute, compiled or not), and that a conditioned sample whose inputs say
``first_frame_in_loss: False`` (``training/step/objective.py``) leaves frame 0, whose target is zero, out of its MSE.
The step's loss is the mean of the samples' losses.

The forward follows DiffSynth 1.1.8's ``model_fn_wan_video`` for the parts a TI2V-5B training uses
(no VACE, CLIP, motion controller, reference latents, TeaCache, sequence parallelism); a pipeline that
needs any of those is refused rather than trained on a different model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffsynth.models.wan_video_dit import sinusoidal_embedding_1d

from diffsynth_mbc.training.step.block_runner import BlockRunner
from diffsynth_mbc.training.step.fp32_residual import residual_in_fp32, time_dtype


def draw_timestep_ids(pipe, samples: list[dict]) -> list[int]:
    """One timestep index per sample, drawn as DiffSynth draws it (``torch.randint`` over the boundaries)."""
    steps = pipe.scheduler.num_train_timesteps
    ids = []
    for inputs in samples:
        low = int(inputs.get("min_timestep_boundary", 0) * steps)
        high = int(inputs.get("max_timestep_boundary", 1) * steps)
        ids.append(int(torch.randint(low, high, (1,))))
    return ids


def batch_loss(pipe, samples: list[dict], runner: BlockRunner, timestep_ids: list[int] | None = None,
               weighting: str = "diffsynth"):
    """Mean training loss of ``samples`` (the dicts the pipeline units or the cache give, each batch 1, all of
    one latent shape) and the per-sample losses, from one DiT forward. ``weighting`` "none" leaves out
    DiffSynth's per-timestep weight (``--loss_weighting``)."""
    if timestep_ids is None:
        timestep_ids = draw_timestep_ids(pipe, samples)
    scheduler = pipe.scheduler
    # On the host, in the model's dtype as DiffSynth rounds them: the scheduler looks up each timestep's sigma and
    # loss weight in its own tables there, and a timestep on the GPU would make the host wait for it each time.
    timesteps = [scheduler.timesteps[i].to(dtype=pipe.torch_dtype) for i in timestep_ids]
    noisy, targets = [], []
    for inputs, timestep in zip(samples, timesteps):
        noisy.append(scheduler.add_noise(inputs["input_latents"], inputs["noise"], timestep))
        targets.append(scheduler.training_target(inputs["input_latents"], inputs["noise"], timestep))
    latents = noisy[0] if len(noisy) == 1 else torch.cat(noisy)
    context = samples[0]["context"] if len(samples) == 1 else torch.cat([s["context"] for s in samples])
    conditioned = [bool(inputs.get("fuse_vae_embedding_in_latents")) for inputs in samples]
    on_device = torch.stack(timesteps).to(pipe.device, non_blocking=True)
    prediction = dit_forward(pipe.dit, latents, on_device, context, runner, conditioned)
    losses = [sample_mse(prediction[b:b + 1], target, skip_first_frame=conditioned[b] and not inputs.get(
        "first_frame_in_loss", True)) for b, (inputs, target) in enumerate(zip(samples, targets))]
    if weighting == "diffsynth":
        losses = [loss * scheduler.training_weight(timestep) for loss, timestep in zip(losses, timesteps)]
    elif weighting != "none":
        raise ValueError(f"loss weighting must be 'diffsynth' or 'none', got {weighting!r}")
    loss = losses[0] if len(losses) == 1 else torch.stack(losses).mean()
    return loss, losses


def sample_mse(prediction: torch.Tensor, target: torch.Tensor, skip_first_frame: bool = False) -> torch.Tensor:
    """The MSE of one sample in fp32; ``skip_first_frame``: the mean over the elements of latent frames 1.. only
    (frame 0 is the clean condition, its target zero)."""
    if skip_first_frame:
        prediction, target = prediction[:, :, 1:], target[:, :, 1:]
    return F.mse_loss(prediction.float(), target.float())


def _refuse_unsupported(dit) -> None:
    if getattr(dit, "require_vae_embedding", False) or getattr(dit, "require_clip_embedding", False):
        raise NotImplementedError("the batched DiT forward covers the TI2V-5B DiT (no image or CLIP embedding); "
                                  "this DiT needs DiffSynth's own model_fn")


def time_modulation(dit, latents: torch.Tensor, timesteps: torch.Tensor, conditioned: list[bool]):
    """(t, t_mod) for a batch. With any sample conditioned on its first frame, per token (the TI2V DiT): that
    sample's first latent frame at timestep 0, every other token at its sample's timestep; else per sample, as
    DiffSynth's ``model_fn_wan_video`` does without a first-frame condition. In fp32 with the fp32 residual stream
    (the timesteps' values are those the noise was added at, rounded to the model's dtype as DiffSynth rounds them)."""
    batch, _, frames, height, width = latents.shape
    timesteps = timesteps.to(time_dtype(dit, latents.dtype))   # fp32 with the fp32 residual stream (fp32_residual.py)
    if dit.seperated_timestep and any(conditioned):
        tokens_per_frame = height * width // 4
        per_token = torch.ones((batch, frames * tokens_per_frame), dtype=timesteps.dtype, device=latents.device) \
            * timesteps.reshape(batch, 1)
        for sample in (b for b, flag in enumerate(conditioned) if flag):   # no mask on the device: nothing to wait for
            per_token[sample, :tokens_per_frame] = 0
        embedded = sinusoidal_embedding_1d(dit.freq_dim, per_token.flatten()).reshape(batch, per_token.shape[1], -1)
        t = dit.time_embedding(embedded)
        return t, dit.time_projection(t).unflatten(2, (6, dit.dim))
    t = dit.time_embedding(sinusoidal_embedding_1d(dit.freq_dim, timesteps.reshape(batch)))
    return t, dit.time_projection(t).unflatten(1, (6, dit.dim))


def rope_table(dit, f: int, h: int, w: int, device) -> torch.Tensor:
    """The 3-D rotary table of an (f, h, w) token grid on ``device``, built from the DiT's tables (kept on the host by
    DiffSynth) once per grid and device: a bucket's steps reuse it instead of copying it to the GPU each forward."""
    tables = dit.__dict__.setdefault("_rope_tables", {})
    key = (f, h, w, str(device))
    if key not in tables:
        tables[key] = torch.cat([
            dit.freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            dit.freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            dit.freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ], dim=-1).reshape(f * h * w, 1, -1).to(device)
    return tables[key]


def dit_forward(dit, latents: torch.Tensor, timesteps: torch.Tensor, context: torch.Tensor, runner: BlockRunner,
                conditioned: list[bool]) -> torch.Tensor:
    """The DiT's prediction for a batch (B, C, F, H, W) with one timestep and one condition flag per sample."""
    _refuse_unsupported(dit)
    t, t_mod = time_modulation(dit, latents, timesteps, conditioned)
    context = dit.text_embedding(context)
    x, (f, h, w) = dit.patchify(latents)
    if residual_in_fp32(dit):   # the stream is fp32 from the first block on: one compiled graph serves every block
        x = x.float()
    freqs = rope_table(dit, f, h, w, x.device)
    for index in range(len(dit.blocks)):
        x = runner(index, x, context, t_mod, freqs)
    # DiffSynth's head adds its (1, 2, dim) modulation to a per-sample t of (B, dim), which only broadcasts for B = 1;
    # as (B, 1, dim) it takes the head's per-token branch: the same sums, for any B.
    x = dit.head(x, t if t.dim() == 3 else t.unsqueeze(1))
    return dit.unpatchify(x, (f, h, w))
