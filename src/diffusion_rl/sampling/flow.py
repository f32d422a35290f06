"""Flow-matching sampling: one loop for serving (ODE) and, with capture, for rollout (SDE).

docs/math.md §5. The schedule runs from σ = 1 (noise) to σ = 0 in ``num_steps`` steps, on the grid
:func:`flow_sigmas` builds (``sigma_schedule``: by default uniform steps in σ shifted by
``σ' = sσ / (1 + (s − 1)σ)``, the FLUX-pipeline form; ``"sd3"``: diffusers' SD3 default). At
each step the velocity comes from one batched forward of the conditional and unconditional
rows (classifier-free guidance :func:`~diffusion_rl.guidance.guided_velocity`,
``v = v_u + g (v_c − v_u)``, combined in float32; ``g = 1`` runs the conditional rows only),
then a step kernel from :data:`~diffusion_rl.kernels.KERNELS`:

* ``mode="ode"`` (serving): every step is ``flow_ode_step``;
* ``mode="sde"`` (rollout): steps inside ``sde_window`` ``[start, end)`` (null: every step but
  the last) are ``flow_sde_step`` with a behaviour log-prob — the trainable steps — the
  others ODE (Flow-GRPO-Fast / MixGRPO windows).

The **last step, to σ = 0, is always an ODE step**: for the ``cps`` variant the step's noise
``σ_next sin(aπ/2)`` is 0 there (no density, no log-prob); for ``flow_grpo`` and ``constant``
it would add fresh noise of scale ``std √σ`` that no later step removes, so the served image
would be noisy. A window may therefore end at ``num_steps − 1`` at most.

Invariants that make rollouts replayable and rows independent:

* all noise is drawn on the CPU in float32 from generators keyed by ``(row seed, step)``
  (initial noise: step −1), so a row's sample does not depend on its batch mates (up to GEMM
  blocking of the model); with ``share_group_noise`` the rows of each group of
  ``group_size`` take the group's first seed for the initial noise only — their SDE noise
  stays their own, so they differ;
* the latent is kept in ``latent_dtype`` after every step and that very tensor is both fed to
  the next forward and stored in the trace (bf16: the rounded tensor, whose log-prob is then
  taken — docs/pitfalls.md, "Stored latent is not the latent continued from"); kernels compute in float32;
* rows run their forwards in groups of ``micro_batch_size`` (the trace records the groups), so
  replay can repeat the sampler's exact shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..guidance import guided_velocity
from ..kernels import KERNELS, Kernel
from ..models.protocol import Conditioning, VelocityModel
from ..seeding import row_step_generator
from ..trace import FlowTrace

FLOW_OPS = ("flow_ode_step", "flow_sde_step")
LATENT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INITIAL_NOISE_STEP = -1
SD3_TRAIN_TIMESTEPS = 1000


class FlowSamplerConfig(BaseModel):
    """Settings of the flow sampler (stored in every trace).

    Defaults follow Flow-GRPO's SD3 rollouts in their settings (10 steps, guidance 4.5, noise
    level 0.7, mean-reduced log-probs, SD3's shift 3), but the default σ grid
    (``sigma_schedule="flux"``) is the FLUX-pipeline form — uniform ``1, (N−1)/N, …, 1/N``,
    shifted, then 0 — not the grid diffusers' SD3 pipeline runs; ``sigma_schedule="sd3"``
    gives that one (see :func:`flow_sigmas`). ``mode`` defaults to serving (``"ode"``).
    ``latent_dtype``: the dtype the latent is kept, fed and stored in between steps.
    ``micro_batch_size``: rows per velocity forward (None: the whole batch). ``kernels`` maps
    an op (``flow_ode_step``, ``flow_sde_step``) to a preferred kernel id; unset ops use the
    reference.

    Strict types: ints are ints (not bools or floats), floats finite, bools bools (YAML lists
    are accepted for ``sde_window``). Recipe configs also bound the sizes
    (``diffusion_rl.config.LIMITS``).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    num_steps: int = Field(default=10, ge=1)
    shift: float = Field(default=3.0, gt=0.0, allow_inf_nan=False)
    guidance_scale: float = Field(default=4.5, ge=0.0, allow_inf_nan=False)
    mode: Literal["ode", "sde"] = "ode"
    noise_level: float = Field(default=0.7, gt=0.0, allow_inf_nan=False)
    variant: Literal["flow_grpo", "constant", "cps"] = "flow_grpo"
    reduction: Literal["mean", "sum"] = "mean"
    sde_window: tuple[int, int] | None = Field(default=None, strict=False)
    share_group_noise: bool = False
    latent_dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batch_size: int | None = Field(default=None, ge=1)
    kernels: dict[str, str] = Field(default_factory=dict)
    sigma_schedule: Literal["flux", "sd3"] = "flux"

    @model_validator(mode="before")
    @classmethod
    def _drop_legacy_keys(cls, data: Any) -> Any:
        # ``progress`` (a progress-bar switch, now ``sample_flow(on_step=...)``) is still in
        # the sampler settings of model directories and traces saved before its removal.
        if isinstance(data, dict) and "progress" in data:
            data = {k: v for k, v in data.items() if k != "progress"}
        window = data.get("sde_window") if isinstance(data, dict) else None
        if isinstance(window, (list, tuple)) and not all(
            isinstance(i, int) and not isinstance(i, bool) for i in window
        ):
            raise ValueError(f"sde_window: expected two integers [start, end), got {list(window)}")
        return data

    @model_validator(mode="after")
    def _check(self) -> FlowSamplerConfig:
        if self.variant == "cps" and self.noise_level > 1:
            raise ValueError(
                f"noise_level: the cps variant takes a in (0, 1] (noise σ_next·sin(aπ/2)), "
                f"got {self.noise_level}"
            )
        if self.mode == "sde" and self.num_steps < 2:
            raise ValueError("num_steps: mode 'sde' needs >= 2 steps (the last step is always ODE)")
        if self.sde_window is not None:
            start, end = self.sde_window
            if not 0 <= start < end <= self.num_steps - 1:
                raise ValueError(
                    f"sde_window: expected 0 <= start < end <= num_steps - 1 = "
                    f"{self.num_steps - 1} (the last step is always ODE), got {self.sde_window}"
                )
        for op, kernel_id in self.kernels.items():
            if op not in FLOW_OPS:
                raise ValueError(f"kernels: unknown operation {op!r}; expected one of {FLOW_OPS}")
            KERNELS.resolve(op, prefer=kernel_id)  # unknown id or wrong op: a named error
        return self

    def sde_steps(self) -> torch.Tensor:
        """Bool ``[num_steps]``: which steps take the SDE kernel (never the last)."""
        steps = torch.zeros(self.num_steps, dtype=torch.bool)
        if self.mode == "sde":
            start, end = self.sde_window or (0, self.num_steps - 1)
            steps[start:end] = True
        return steps


@dataclass(frozen=True)
class FlowSample:
    """``latents`` ``[B, *latent_shape]`` (the final σ = 0 sample, in ``latent_dtype``),
    ``images`` = ``model.decode(latents)`` (None when not decoded), ``trace`` with capture."""

    latents: torch.Tensor
    images: torch.Tensor | None
    trace: FlowTrace | None


def flow_sigmas(
    num_steps: int,
    shift: float,
    schedule: Literal["flux", "sd3"] = "flux",
    *,
    num_train_timesteps: int = SD3_TRAIN_TIMESTEPS,
) -> torch.Tensor:
    """Float32 σ grid ``[num_steps + 1]``, from 1 (noise) down to a final exact 0.

    ``"flux"`` (the default; the FLUX-pipeline form): uniform steps in σ,
    ``σ_k = 1 − k/N`` for ``k = 0..N``, shifted ``σ' = sσ / (1 + (s − 1)σ)`` (computed in
    float64, rounded once); the shift keeps 1 and 0 exact.

    ``"sd3"``: diffusers' ``FlowMatchEulerDiscreteScheduler(shift=s).set_timesteps(N)`` as
    ``StableDiffusion3Pipeline`` calls it (no explicit sigmas, no dynamic shifting), value for
    value: the training grid ``t/T`` for ``t = T..1`` (``T = num_train_timesteps``) is shifted
    in float32 and its ends are taken, ``σ_max`` (1 up to float32 rounding) and ``σ_min`` (the
    shift of ``1/T``); the inference grid ``linspace(σ_max, σ_min, N)`` is shifted AGAIN
    (float64, rounded once) and 0 is appended. So the shift acts twice and the last step
    starts from ``σ_min'`` > 0.
    """
    if schedule == "flux":
        sigma = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        return (shift * sigma / (1 + (shift - 1) * sigma)).float()
    if schedule != "sd3":
        raise ValueError(f"schedule: expected 'flux' or 'sd3', got {schedule!r}")
    train = torch.tensor([num_train_timesteps, 1.0], dtype=torch.float32) / num_train_timesteps
    train = shift * train / (1 + (shift - 1) * train)  # as diffusers' __init__, float32
    sigma_max, sigma_min = train.tolist()
    timesteps = np.linspace(
        sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps
    )
    sigma = timesteps / num_train_timesteps
    sigma = shift * sigma / (1 + (shift - 1) * sigma)  # set_timesteps shifts again, float64
    return torch.cat([torch.from_numpy(sigma).float(), torch.zeros(1)])


def step_noise(seeds: Sequence[int], step: int, shape: tuple[int, ...], device) -> torch.Tensor:
    """Float32 standard normal ``[B, *shape]``, row b drawn from ``(seeds[b], step)`` alone."""
    rows = [torch.randn(shape, generator=row_step_generator(seed, step)) for seed in seeds]
    return torch.stack(rows).to(device)


def model_device(model) -> torch.device:
    """The device of the model's first parameter (CPU for parameter-less models)."""
    parameters = getattr(model, "parameters", None)
    if callable(parameters):
        for param in parameters():
            return param.device
    return torch.device("cpu")


def _check_cond(name: str, cond: Conditioning, rows: int) -> Conditioning:
    if not isinstance(cond, dict) or not cond:
        raise TypeError(f"{name}: expected a non-empty dict of tensors, got {type(cond).__name__}")
    for key, value in cond.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows:
            raise ValueError(f"{name}[{key!r}]: expected a batch-first tensor [B={rows}, ...]")
    return cond


@torch.no_grad()
def sample_flow(
    model: VelocityModel,
    prompts: Sequence[str],
    config: FlowSamplerConfig,
    *,
    seeds: Sequence[int] | torch.Tensor,
    capture: bool = False,
    weights_version: int = 0,
    group_size: int | None = None,
    cond: Conditioning | None = None,
    uncond: Conditioning | None = None,
    decode: bool = True,
    on_step: Callable[[int], None] | None = None,
    stage: str = "",
    init_seeds: Sequence[int] | None = None,
) -> FlowSample:
    """Generate one sample per prompt.

    ``seeds``: one int per row. ``group_size``: rows come in consecutive groups of this size
    (the G samples of one prompt); required by ``share_group_noise`` unless ``init_seeds``
    gives each row's initial-noise seed itself (the group's first seed, for rows of groups
    cut across processes; ignored without ``share_group_noise``). ``cond`` / ``uncond``
    replace ``model.encode_prompts(prompts)`` / ``model.empty_condition(B)`` when given.
    ``capture=True`` returns a :class:`~diffusion_rl.trace.FlowTrace` stamped with
    ``weights_version``, the kernel ids used and ``stage`` (the workflow stage sampling it;
    ``""`` outside workflows). Call it under ``torch.autocast`` to roll out
    in mixed precision (replay then runs under the same autocast). ``on_step(done)``, when
    given, is called after every finished step of every forward group with the number of
    such steps done so far (``num_steps × ceil(B / micro_batch_size)`` in all), e.g. to drive
    a progress bar; it does not change the samples.
    """
    prompts = list(prompts)
    batch = len(prompts)
    if batch == 0:
        raise ValueError("prompts: expected at least one prompt, got none")
    seeds = [int(s) for s in (seeds.tolist() if isinstance(seeds, torch.Tensor) else seeds)]
    if len(seeds) != batch:
        raise ValueError(f"seeds: expected one per row ({batch}), got {len(seeds)}")
    if config.share_group_noise and group_size is None and init_seeds is None:
        raise ValueError("group_size: share_group_noise needs the group size of the batch")
    if group_size is not None and (group_size < 1 or batch % group_size):
        raise ValueError(
            f"group_size: expected a divisor of the batch size {batch}, got {group_size}"
        )
    device = model_device(model)
    latent_dtype = LATENT_DTYPES[config.latent_dtype]
    shape = tuple(model.latent_shape)

    cond = _check_cond("cond", cond if cond is not None else model.encode_prompts(prompts), batch)
    cond = {k: v.to(device) for k, v in cond.items()}
    guided = config.guidance_scale != 1.0
    if guided:
        uncond = uncond if uncond is not None else model.empty_condition(batch)
        uncond = {k: v.to(device) for k, v in _check_cond("uncond", uncond, batch).items()}
    else:
        uncond = None

    sigmas = flow_sigmas(config.num_steps, config.shift, config.sigma_schedule).to(device)
    sde_steps = config.sde_steps()
    kernels = {op: KERNELS.resolve(op, device, config.kernels.get(op)) for op in FLOW_OPS}
    if not config.share_group_noise:
        init_seeds = seeds
    elif init_seeds is not None:
        init_seeds = [int(s) for s in init_seeds]
        if len(init_seeds) != batch:
            raise ValueError(f"init_seeds: expected one per row ({batch}), got {len(init_seeds)}")
    else:
        init_seeds = [seeds[(b // group_size) * group_size] for b in range(batch)]

    size = config.micro_batch_size or batch
    groups = [list(range(lo, min(batch, lo + size))) for lo in range(0, batch, size)]
    latents, logprobs = [], []
    for g, rows in enumerate(groups):
        run = _sample_rows(
            model,
            config,
            kernels,
            sigmas,
            sde_steps,
            initial=step_noise([init_seeds[b] for b in rows], INITIAL_NOISE_STEP, shape, device),
            seeds=[seeds[b] for b in rows],
            cond={k: v[rows[0] : rows[-1] + 1] for k, v in cond.items()},
            uncond=None
            if uncond is None
            else {k: v[rows[0] : rows[-1] + 1] for k, v in uncond.items()},
            latent_dtype=latent_dtype,
            on_step=None
            if on_step is None
            else (lambda k, done=g * config.num_steps: on_step(done + k)),
        )
        latents.append(run[0])
        logprobs.append(run[1])
    path = torch.cat(latents)
    final = path[:, -1]
    images = model.decode(final) if decode else None
    trace = None
    if capture:
        used = ["flow_ode_step"] + (["flow_sde_step"] if bool(sde_steps.any()) else [])
        trace = FlowTrace(
            latents=path,
            sigmas=sigmas.cpu(),
            sde_steps=sde_steps,
            behaviour_logprobs=torch.cat(logprobs),
            cond=cond,
            uncond=uncond,
            prompts=prompts,
            seeds=torch.tensor(seeds, dtype=torch.long),
            forward_groups=torch.tensor(
                [g for g, rows in enumerate(groups) for _ in rows], dtype=torch.long
            ),
            sampler={
                **config.model_dump(),
                "latent_shape": list(shape),
                "group_size": group_size,
            },
            kernel_ids={op: kernels[op].kernel_id for op in used},
            weights_version=int(weights_version),
            model_info={"class": type(model).__name__},
            stage=stage,
        )
    return FlowSample(latents=final, images=images, trace=trace)


def _sample_rows(
    model: VelocityModel,
    config: FlowSamplerConfig,
    kernels: dict[str, Kernel],
    sigmas: torch.Tensor,
    sde_steps: torch.Tensor,
    *,
    initial: torch.Tensor,
    seeds: list[int],
    cond: Conditioning,
    uncond: Conditioning | None,
    latent_dtype: torch.dtype,
    on_step: Callable[[int], None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward group through every step → latents ``[b, N+1, *]``, log-probs ``[b, N]``."""
    rows = initial.shape[0]
    x = initial.to(latent_dtype)
    path = [x]
    logprobs = torch.zeros(rows, config.num_steps, dtype=torch.float32, device=x.device)
    sde_kernel, ode_kernel = kernels["flow_sde_step"].fn, kernels["flow_ode_step"].fn
    for k in range(config.num_steps):
        sigma, sigma_next = sigmas[k].repeat(rows), sigmas[k + 1].repeat(rows)
        v = guided_velocity(model, x, sigma, cond, uncond, config.guidance_scale)
        if bool(sde_steps[k]):
            options = dict(
                noise_level=config.noise_level, variant=config.variant, reduction=config.reduction
            )
            noise = step_noise(seeds, k, tuple(x.shape[1:]), x.device)
            sample, logprob, _, _ = sde_kernel(x, v, sigma, sigma_next, noise=noise, **options)
            x_next = sample.to(latent_dtype)
            if latent_dtype != torch.float32:  # the log-prob of the rounded tensor we keep
                logprob = sde_kernel(x, v, sigma, sigma_next, prev_sample=x_next, **options)[1]
            logprobs[:, k] = logprob
        else:
            x_next = ode_kernel(x, v, sigma, sigma_next).to(latent_dtype)
        path.append(x_next)
        x = x_next
        if on_step is not None:
            on_step(k + 1)
    return torch.stack(path, dim=1), logprobs
