"""Multi-stage workflows: a chain of flow generators, served and rolled out by one loop.

A workflow is a declarative chain of *stages* (:class:`WorkflowSpec`, YAML or a built-in
name). Each stage is a model directory and its sampler settings; a stage with an ``input``
is conditioned on the artefact of an earlier stage (text → image → video: the image stage's
picture is the video stage's first frame). :meth:`Workflow.run` runs the chain:

1. stage 0 samples one output per prompt with the given seeds;
2. every later stage takes each row of its input stage ``fanout`` times (a tree: K videos
   per image), with seeds :func:`stage_seed` ``(parent seed, stage index, member)``, and is
   conditioned on the input artefact *as the exact tensor* the input stage decoded — never
   through a file round trip — through the model's deterministic
   ``encode_conditioning(prompts, images)`` (and ``empty_conditioning(images)`` for the
   classifier-free-guidance branch: same image, null prompt);
3. each stage's output is decoded (images ``[B, 3, H, W]``, videos ``[B, F, 3, H, W]``, in
   ``[0, 1]``) and handed on.

Serving and rollout are the same call: ``capture=True`` also records one
:class:`~diffusion_rl.trace.FlowTrace` per stage, stamped with the stage's name and its own
weights version. Capture changes nothing that is sampled, so for the same seeds the
artefacts of a served run and of a captured rollout are bitwise equal.

Prompts: with a ``task`` (e.g. ``mini-motion``) each workflow prompt is parsed into the
task's example, and a stage's ``prompt`` names the example field it is given (the image
stage of ``text-to-image-to-video`` reads ``image_prompt``, "a red circle in the center",
from "a red circle moving left fast"). Without a task every stage gets the prompt itself.

Model paths in a workflow file are relative to the file's directory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .sampling.flow import FlowSample, FlowSamplerConfig, sample_flow
from .seeding import noise_key
from .trace import FlowTrace

__all__ = [
    "BUILTIN_WORKFLOWS",
    "StageOutput",
    "StageSpec",
    "Workflow",
    "WorkflowError",
    "WorkflowRun",
    "WorkflowSpec",
    "load_stage_model",
    "load_workflow_spec",
    "stage_seed",
]

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_STAGE_SEED_TAG = 0x574B464C  # "WKFL": keeps stage seeds apart from other noise keys


class WorkflowError(ValueError):
    """A workflow that cannot run as specified (the message names the stage and field)."""


class StageSpec(BaseModel):
    """One stage: ``name`` (lower-case identifier), ``model`` (a model directory: a built-in
    model's, or a local diffusers pipeline directory such as Wan 2.1 image-to-video, loaded
    with ``model_options`` e.g. ``{height: 480, width: 832, num_frames: 81}``; relative paths
    are resolved against the workflow file), ``input`` (the earlier stage whose
    artefact conditions this one; None for a text-conditioned first stage), ``prompt`` (the
    task-example field this stage is prompted with), ``fanout`` (samples per input row, for
    tree rollouts and serving several videos per image) and ``sampler`` settings."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    model: str
    model_options: dict[str, Any] = {}
    input: str | None = None
    prompt: str = "prompt"
    fanout: int = Field(default=1, ge=1, le=64)
    sampler: FlowSamplerConfig = FlowSamplerConfig()

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"expected a lower-case identifier (letters, digits, _; at most 32), got {value!r}"
            )
        return value

    @field_validator("sampler")
    @classmethod
    def _check_sampler(cls, value: FlowSamplerConfig) -> FlowSamplerConfig:
        if value.share_group_noise:
            raise ValueError(
                "share_group_noise: a workflow file holds the serving samplers, and served rows "
                "each start from their own noise; share a group's noise in the rollouts "
                "(workflow-rl: stages.NAME.sampler.share_group_noise: true)"
            )
        return value


class WorkflowSpec(BaseModel):
    """A chain of stages; ``task`` (optional) is the ``info()`` of the task whose examples
    the prompts are (``{"name": "mini-motion", ...}``). Stage names are unique, the first
    stage has no input, and every input names an earlier stage."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = "workflow"
    task: dict[str, Any] | None = None
    stages: list[StageSpec] = Field(min_length=1, max_length=8)

    @model_validator(mode="after")
    def _check_chain(self) -> WorkflowSpec:
        seen: list[str] = []
        for index, stage in enumerate(self.stages):
            if stage.name in seen:
                raise ValueError(f"stages[{index}].name: {stage.name!r} is used twice")
            if index == 0 and stage.input is not None:
                raise ValueError(
                    f"stages[0].input: the first stage is conditioned on the prompt only, got "
                    f"input {stage.input!r}"
                )
            if index > 0 and stage.input not in seen:
                raise ValueError(
                    f"stages[{index}].input: expected one of the earlier stages {seen}, got "
                    f"{stage.input!r}"
                )
            if index == 0 and stage.fanout != 1:
                raise ValueError(
                    "stages[0].fanout: the first stage samples one output per prompt row "
                    "(repeat the prompts for more)"
                )
            seen.append(stage.name)
        return self

    def stage(self, name: str) -> StageSpec:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"stage {name!r}: this workflow has stages {[s.name for s in self.stages]}")


BUILTIN_WORKFLOWS: dict[str, str] = {
    "text-to-image-to-video": "runs/quickstart_workflow/workflow.yaml",
}
"""Built-in workflow names → the workflow file ``quickstart --mode workflow`` writes (its
image stage is the mini-GenEval FlowDiT, its video stage the mini-motion VideoDiT)."""


def load_workflow_spec(source: str | Path) -> tuple[WorkflowSpec, Path]:
    """The workflow a file or a built-in name describes, with model paths made absolute;
    returns ``(spec, file)``. Raises :class:`WorkflowError` naming the file and field."""
    text = str(source)
    path = Path(BUILTIN_WORKFLOWS.get(text, text))
    if not path.is_file():
        hint = (
            f"the built-in workflow {text!r} is written by `diffusion-rl quickstart --mode "
            "workflow`; run it first"
            if text in BUILTIN_WORKFLOWS
            else f"pass a workflow YAML file or one of {sorted(BUILTIN_WORKFLOWS)}"
        )
        raise WorkflowError(f"workflow: {path} does not exist; {hint}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise WorkflowError(f"workflow: {path} is not valid YAML: {error}") from None
    try:
        spec = WorkflowSpec.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(map(str, item['loc']))}: {item['msg']}" for item in error.errors()
        )
        raise WorkflowError(f"workflow: {path}: {problems}") from None
    stages = [
        stage.model_copy(update={"model": str((path.parent / stage.model).resolve())})
        for stage in spec.stages
    ]
    return spec.model_copy(update={"stages": stages}), path


def load_stage_model(stage: StageSpec):
    """The velocity model of ``stage``: a diffusers pipeline directory (``model_index.json``)
    through its adapter with ``model_options``, else a built-in model directory
    (:func:`~diffusion_rl.models.io.load_model`, which takes no options). Raises
    :class:`WorkflowError` naming the stage."""
    path = Path(stage.model)
    try:
        if (path / "model_index.json").is_file():
            from .models.diffusers_adapters import adapter_for_directory

            return adapter_for_directory(path).from_pretrained(path, **stage.model_options)
        if stage.model_options:
            raise WorkflowError(
                f"stage {stage.name!r}: model_options apply to diffusers pipeline directories; "
                f"{path} is a built-in model directory (remove model_options)"
            )
        from .models.io import load_model

        loaded = load_model(path)
    except (FileNotFoundError, TypeError, ValueError) as error:
        if isinstance(error, WorkflowError):
            raise
        raise WorkflowError(f"stage {stage.name!r}: {error}") from None
    if loaded.kind != "flow":
        raise WorkflowError(
            f"stage {stage.name!r}: {path} holds a {loaded.kind} model; workflow stages are flow "
            "models"
        )
    return loaded.model


def stage_seed(parent_seed: int, stage_index: int, member: int) -> int:
    """The seed of member ``member`` of stage ``stage_index`` grown from a row seeded
    ``parent_seed`` of its input stage (a 63-bit key; distinct per member and stage)."""
    return noise_key(_STAGE_SEED_TAG, int(parent_seed), int(stage_index), int(member))


@dataclass(frozen=True)
class StageOutput:
    """One stage's rows: ``prompts``/``seeds`` per row, ``parents`` long ``[B]`` (the row of
    the input stage each row grew from; ``arange`` for the first stage), ``roots`` long
    ``[B]`` (the first-stage row, i.e. the prompt row, each row descends from), ``artefact`` (the
    decoded output: images ``[B, 3, H, W]`` or videos ``[B, F, 3, H, W]``, float32 in
    ``[0, 1]``), ``latents`` ``[B, *latent_shape]`` and ``trace`` (with capture)."""

    name: str
    prompts: list[str]
    seeds: list[int]
    parents: torch.Tensor
    roots: torch.Tensor
    artefact: torch.Tensor
    latents: torch.Tensor
    trace: FlowTrace | None


@dataclass(frozen=True)
class WorkflowRun:
    """The outputs of every stage, in chain order; ``examples`` the parsed task examples of
    the first stage's rows (the prompts themselves without a task)."""

    stages: dict[str, StageOutput]
    examples: list[Any]

    @property
    def final(self) -> StageOutput:
        return list(self.stages.values())[-1]

    def examples_of(self, name: str) -> list[Any]:
        """The task example behind each row of stage ``name``."""
        return [self.examples[i] for i in self.stages[name].roots.tolist()]


class Workflow:
    """A :class:`WorkflowSpec` with a model per stage (``models``: name → velocity model;
    rollouts pass the stages' rollout weights, serving the loaded directories)."""

    def __init__(self, spec: WorkflowSpec, models: Mapping[str, Any], task: Any | None = None):
        names = [stage.name for stage in spec.stages]
        if set(models) != set(names):
            raise WorkflowError(f"models: expected one per stage {names}, got {sorted(models)}")
        self.spec = spec
        self.models = dict(models)
        self.task = task
        for stage in spec.stages:
            self._check_stage(stage)

    def _check_stage(self, stage: StageSpec) -> None:
        model = self.models[stage.name]
        if stage.input is None:
            return
        for method in ("encode_conditioning", "empty_conditioning"):
            if not callable(getattr(model, method, None)):
                raise WorkflowError(
                    f"stage {stage.name!r}: it takes the {stage.input!r} stage's output as input, "
                    f"but its model ({type(model).__name__}) has no {method}(...); use an "
                    "image-to-video model (VideoDiT, Wan image-to-video)"
                )
        source = self.models[stage.input]
        produced = tuple(source.latent_shape)
        wanted = tuple(getattr(model, "image_shape", produced))
        if len(produced) != 3 or (produced[1:] != wanted[1:]):
            raise WorkflowError(
                f"stage {stage.name!r}: it takes images of shape {wanted}, stage "
                f"{stage.input!r} makes {produced}; give both models the same image size"
            )

    def _examples(self, prompts: Sequence[Any]) -> list[Any]:
        if self.task is None:
            return [p if isinstance(p, str) else p.prompt for p in prompts]
        return [self.task.to_example(p) if isinstance(p, str) else p for p in prompts]

    def _prompts(self, stage: StageSpec, examples: Sequence[Any]) -> list[str]:
        if isinstance(examples[0], str):
            if stage.prompt != "prompt":
                raise WorkflowError(
                    f"stage {stage.name!r}: prompt field {stage.prompt!r} needs a task to parse "
                    "the workflow prompts into examples; set the workflow's task"
                )
            return list(examples)
        try:
            return [getattr(example, stage.prompt) for example in examples]
        except AttributeError:
            raise WorkflowError(
                f"stage {stage.name!r}: prompt: the task's examples have no field {stage.prompt!r}"
            ) from None

    @torch.no_grad()
    def run(
        self,
        prompts: Sequence[Any],
        seeds: Sequence[int],
        *,
        capture: bool = False,
        versions: Mapping[str, int] | None = None,
        samplers: Mapping[str, FlowSamplerConfig] | None = None,
        fanout: Mapping[str, int] | None = None,
        init_seeds: Sequence[int] | None = None,
    ) -> WorkflowRun:
        """Run every stage (module doc). ``seeds``: one per prompt (the first stage's rows).
        ``versions``: each stage's weights version stamped into its trace (default 0);
        ``samplers`` / ``fanout``: per-stage overrides of the spec (e.g. the serving or the
        rollout settings). With a sampler's ``share_group_noise`` the rows of one group start
        from the same noise: a later stage's group is the ``fanout`` rows grown from one input
        row (they start from its member 0's noise); the first stage's rows start from
        ``init_seeds`` (one per row, e.g. the seed of the row's prompt group), which that
        setting then requires."""
        if len(prompts) == 0 or len(prompts) != len(seeds):
            raise WorkflowError(
                f"prompts / seeds: expected one seed per prompt (at least one), got "
                f"{len(prompts)} prompts and {len(seeds)} seeds"
            )
        versions, samplers, fanout = dict(versions or {}), dict(samplers or {}), dict(fanout or {})
        examples = self._examples(prompts)
        outputs: dict[str, StageOutput] = {}
        for index, stage in enumerate(self.spec.stages):
            model = self.models[stage.name]
            config = samplers.get(stage.name, stage.sampler)
            cond = uncond = None
            group, starts = None, None
            if stage.input is None:
                parents = roots = torch.arange(len(examples))
                stage_seeds = [int(s) for s in seeds]
                if config.share_group_noise:
                    if init_seeds is None or len(init_seeds) != len(seeds):
                        raise WorkflowError(
                            f"stage {stage.name!r}: sampler.share_group_noise needs init_seeds "
                            f"(one start-noise seed per prompt row, {len(seeds)}); pass them "
                            "or set share_group_noise: false"
                        )
                    starts = [int(s) for s in init_seeds]
            else:
                source = outputs[stage.input]
                k = group = fanout.get(stage.name, stage.fanout)
                parents = torch.arange(len(source.seeds)).repeat_interleave(k)
                stage_seeds = [
                    stage_seed(source.seeds[p], index, m)
                    for p in range(len(source.seeds))
                    for m in range(k)
                ]
                roots = source.roots[parents]
                images = source.artefact[parents]
                texts = self._prompts(stage, [examples[i] for i in roots.tolist()])
                cond = model.encode_conditioning(texts, images)
                if config.guidance_scale != 1.0:
                    uncond = model.empty_conditioning(images)
            if stage.input is None:
                texts = self._prompts(stage, examples)
            sample: FlowSample = sample_flow(
                model,
                texts,
                config,
                seeds=stage_seeds,
                capture=capture,
                weights_version=int(versions.get(stage.name, 0)),
                cond=cond,
                uncond=uncond,
                stage=stage.name,
                group_size=group,
                init_seeds=starts,
            )
            outputs[stage.name] = StageOutput(
                name=stage.name,
                prompts=texts,
                seeds=stage_seeds,
                parents=parents,
                roots=roots,
                artefact=sample.images.float(),
                latents=sample.latents,
                trace=sample.trace,
            )
        return WorkflowRun(outputs, list(examples))
