"""The one rollout collector: captured samples of G members per prompt, rewards, advantages.

A rollout is the serving sampler with capture on, run by the *rollout weights* (whose version
every trace carries). :func:`collect_rollout` works for both worlds through a small
*source* that knows how to sample one world (:class:`TokenSource`: a token denoiser on a text
task; :class:`FlowSource`: a velocity model on an image task):

1. the train prompts ``start_prompt, ...`` each get ``group_size`` samples with seeds
   :func:`rollout_seed` (a function of the run seed, the prompt position and the member, so
   the stream does not depend on batch composition);
2. ``reward_fn(outputs, examples)`` scores them (texts or images), plus optional reward
   shaping (e.g. DAPO's :class:`~diffusion_rl.advantages.OverlongShaping`);
3. with ``dynamic_sampling`` (DAPO), groups whose rewards are all equal carry no signal and
   are dropped; further prompts are sampled until the batch holds ``num_prompts`` groups or
   ``max_sampling_rounds`` is reached (``stats['rollout/groups_short']`` says by how much);
4. advantages per group (:func:`~diffusion_rl.advantages.group_advantages`) when an
   :class:`~diffusion_rl.advantages.AdvantageSpec` is given.

The result is one :class:`Rollout` value; the learner trains on it
(:meth:`~diffusion_rl.train.learner.PolicyLearner.step`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .advantages import AdvantageSpec, flat_groups, group_advantages
from .distributed import World
from .sampling.flow import FlowSamplerConfig, sample_flow
from .sampling.token import TokenSamplerConfig, sample_tokens
from .trace import FlowTrace, TokenTrace

_SEED_MIX = 1_000_003

Outputs = list[str] | torch.Tensor  # decoded texts, or images [B, C, H, W] float32 in [0, 1]


def rollout_seed(seed: int, prompt_index: int, member: int) -> int:
    """Seed of group member ``member`` for train prompt ``prompt_index`` (distinct per sample)."""
    return (seed * _SEED_MIX + prompt_index) * 64 + member


@dataclass(frozen=True)
class Rollout:
    """``B = groups × group_size`` rows; consecutive rows of a group share a prompt.

    ``trace`` (a :class:`TokenTrace` or :class:`FlowTrace`), ``outputs`` (what was
    generated), ``examples`` (the task examples answered), ``rewards [B]`` float32 after
    shaping, ``advantages [B]`` float32 (None when none were asked for), ``reward_parts``
    (each named reward term ``[B]``), ``stats`` (what the rollout looked like), ``ghost``
    (under several processes: the rows stand in for a rank that kept none, and train ×0),
    ``shard`` (under several processes: this rank's rows only, so a group may be cut).
    """

    trace: TokenTrace | FlowTrace
    outputs: Outputs
    examples: list[Any]
    rewards: torch.Tensor
    advantages: torch.Tensor | None
    group_size: int
    reward_parts: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    ghost: bool = False  # a stand-in row of a rank that kept none: trained with weight 0
    shard: bool = False  # this process's rows of a batch shared by several: groups may be cut

    def __post_init__(self) -> None:
        size = len(self.trace)
        sizes = {"outputs": len(self.outputs), "examples": len(self.examples)}
        sizes["rewards"] = self.rewards.shape[0]
        if self.advantages is not None:
            sizes["advantages"] = self.advantages.shape[0]
        sizes.update({f"reward_parts[{k!r}]": v.shape[0] for k, v in self.reward_parts.items()})
        for name, value in sizes.items():
            if value != size:
                raise ValueError(f"Rollout.{name}: expected {size} rows (the trace), got {value}")
        if self.group_size < 1 or (size % self.group_size and not self.shard):
            raise ValueError(
                f"Rollout: {size} rows is not a multiple of group_size={self.group_size}"
            )

    def __len__(self) -> int:
        return len(self.trace)

    def rows(self, index: torch.Tensor) -> Rollout:
        """The rows ``index`` (long tensor), every field sliced alike."""
        return replace(
            self,
            trace=self.trace.rows(index),
            outputs=_take(self.outputs, index),
            examples=[self.examples[i] for i in index.tolist()],
            rewards=self.rewards[index],
            advantages=None if self.advantages is None else self.advantages[index],
            reward_parts={k: v[index] for k, v in self.reward_parts.items()},
        )

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """Rows of several rollouts of one step: equal group sizes and reward terms; the traces
        must agree on settings, kernels and version (checked by the trace's ``concat``)."""
        if not parts:
            raise ValueError("Rollout.concat: expected at least one rollout, got none")
        first = parts[0]
        for k, part in enumerate(parts[1:], start=1):
            if part.group_size != first.group_size:
                raise ValueError(
                    f"Rollout.concat: rollout {k} has group_size {part.group_size}, "
                    f"rollout 0 {first.group_size}"
                )
            if set(part.reward_parts) != set(first.reward_parts):
                raise ValueError(
                    f"Rollout.concat: rollout {k} has rewards {sorted(part.reward_parts)}"
                )
            if (part.advantages is None) != (first.advantages is None):
                raise ValueError(f"Rollout.concat: rollout {k} disagrees on having advantages")
        return Rollout(
            trace=type(first.trace).concat([p.trace for p in parts]),
            outputs=_cat([p.outputs for p in parts]),
            examples=[e for p in parts for e in p.examples],
            rewards=torch.cat([p.rewards for p in parts]),
            advantages=None
            if first.advantages is None
            else torch.cat([p.advantages for p in parts]),
            group_size=first.group_size,
            shard=any(p.shard for p in parts),
            reward_parts={
                k: torch.cat([p.reward_parts[k] for p in parts]) for k in first.reward_parts
            },
        )


def _take(outputs: Outputs, index: torch.Tensor) -> Outputs:
    return (
        outputs[index]
        if isinstance(outputs, torch.Tensor)
        else [outputs[i] for i in index.tolist()]
    )


def _cat(parts: Sequence[Outputs]) -> Outputs:
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(list(parts))
    return [o for part in parts for o in part]


# --------------------------------------------------------------------------------- sources
class TokenSource:
    """The token world: ``task`` prompts → :class:`TokenTrace` and decoded completions."""

    def __init__(self, task, sampler: TokenSamplerConfig) -> None:
        self.task = task
        self.sampler = sampler

    def sample(
        self, model, examples, seeds, weights_version: int, group_seeds=None
    ) -> tuple[TokenTrace, list[str]]:
        """``group_seeds`` (each row's group's first seed) is for samplers that share noise
        within a group; tokens draw per row and ignore it."""
        data = self.task.encode(examples)
        trace = sample_tokens(
            model,
            data["prompt_ids"],
            data["prompt_mask"],
            self.sampler,
            seeds=seeds,
            stop_token_id=self.task.tokenizer.eos_id,
            capture=True,
            weights_version=weights_version,
        ).trace
        return trace, self.task.tokenizer.batch_decode(trace.tokens)

    def stats(self, rollout: Rollout) -> dict[str, float]:
        return {
            "rollout/accuracy": float(self.task.rewards(rollout.outputs, rollout.examples).mean()),
            "rollout/mean_length": float(rollout.trace.lengths().float().mean()),
        }


class FlowSource:
    """The flow world: ``task`` prompts → :class:`FlowTrace` and images (float32 ``[0, 1]``).

    ``group_size`` tells the sampler which rows form a group (shared start noise when the
    sampler config asks for it)."""

    def __init__(self, task, sampler: FlowSamplerConfig, group_size: int) -> None:
        self.task = task
        self.sampler = sampler
        self.group_size = group_size

    def sample(
        self, model, examples, seeds, weights_version: int, group_seeds=None
    ) -> tuple[FlowTrace, torch.Tensor]:
        """``group_seeds``: each row's group's first seed (rows of a group cut between
        processes still share its start noise); None: the rows are whole groups."""
        sample = sample_flow(
            model,
            [e.prompt for e in examples],
            self.sampler,
            seeds=seeds,
            capture=True,
            weights_version=weights_version,
            group_size=self.group_size if group_seeds is None else None,
            init_seeds=group_seeds,
        )
        return sample.trace, sample.images.float()

    def stats(self, rollout: Rollout) -> dict[str, float]:
        correct = self.task.rewards(rollout.outputs, rollout.examples, mode="all")
        return {"rollout/accuracy": float(correct.mean())}


# ------------------------------------------------------------------------------ collector
def collect_rollout(
    model,
    source: TokenSource | FlowSource,
    reward_fn: Callable[[Outputs, list[Any]], Any],
    *,
    start_prompt: int,
    num_prompts: int,
    group_size: int,
    weights_version: int,
    seed: int,
    advantage: AdvantageSpec | None = None,
    shaping: Callable[[TokenTrace | FlowTrace], torch.Tensor] | None = None,
    dynamic_sampling: bool = False,
    max_sampling_rounds: int = 1,
    world: World | None = None,
) -> tuple[Rollout, int]:
    """Sample ``num_prompts`` groups from train prompts ``start_prompt, ...`` with ``model``
    (the rollout weights, at ``weights_version``); returns the rollout and the next prompt
    position (see the module doc). ``shaping(trace) -> [B]`` is added to the rewards under
    its ``name``.

    Under several processes (``world``, default :meth:`World.current`) each rank samples its
    contiguous share of each round's rows (:meth:`World.shard`; a group may be cut between
    ranks) and returns its rows only; rewards are gathered, so the choice of informative
    groups, the advantages and the stats are those of the whole batch, the same on every
    rank and the same as one process computes. A rank left without a kept row gets one of its
    sampled rows as a *ghost* (``Rollout.ghost``: trained ×0) so that every rank runs the
    same passes."""
    world = world or World.current()
    if num_prompts * group_size < world.size:
        raise ValueError(
            f"prompts_per_step × group_size = {num_prompts * group_size} rows cannot be shared "
            f"by {world.size} processes; sample at least one row per process"
        )
    position, have, sampled_groups, rounds = start_prompt, 0, 0, 0
    kept: list[Rollout] = []
    kept_rewards: list[torch.Tensor] = []  # the whole batch's kept rewards, in row order
    positions: list[torch.Tensor] = []  # where this rank's kept rows are among them
    sampled: list[torch.Tensor] = []
    spare: Rollout | None = None  # this rank's first sampled rows, for a ghost
    while have < num_prompts and rounds < (max_sampling_rounds if dynamic_sampling else 1):
        need = num_prompts - have
        indices = range(position, position + need)
        position += need
        rows = [(i, g) for i in indices for g in range(group_size)]
        mine = world.shard(len(rows))
        part = None
        local = torch.zeros(0)
        if len(mine):
            own = [rows[r] for r in mine]
            examples = [source.task.example(i, "train") for i, _ in own]
            seeds = [rollout_seed(seed, i, g) for i, g in own]
            extra = {}
            if world.distributed:  # a group cut between ranks keeps its shared start noise
                extra["group_seeds"] = [rollout_seed(seed, i, 0) for i, _ in own]
            trace, outputs = source.sample(model, examples, seeds, weights_version, **extra)
            scored = reward_fn(outputs, examples)
            local, parts = scored.total, dict(scored.parts)
            if shaping is not None:
                parts[shaping.name] = shaping(trace)
                local = local + parts[shaping.name]
            cut = world.distributed
            part = Rollout(trace, outputs, examples, local, None, group_size, parts, shard=cut)
            spare = spare or part
        rewards = world.gather_rows(local.float())
        sampled_groups += need
        rounds += 1
        sampled.append(rewards)
        keep = torch.ones(len(rows), dtype=torch.bool)
        if dynamic_sampling:
            groups = rewards.view(-1, group_size)
            informative = ~flat_groups(groups)
            if not bool(informative.any()):
                continue
            keep = informative.repeat_interleave(group_size)
            have += int(informative.sum())
        else:
            have += need
        offset = sum(len(r) for r in kept_rewards)
        kept_rewards.append(rewards[keep])
        order = torch.cumsum(keep.long(), 0) - 1  # each kept row's place among the kept
        mine_kept = torch.tensor([r for r in mine if keep[r]], dtype=torch.long)
        if part is not None and len(mine_kept):
            kept.append(part.rows(mine_kept - mine.start) if not bool(keep.all()) else part)
            positions.append(offset + order[mine_kept])
    if not kept_rewards:
        raise RuntimeError(
            f"dynamic sampling: all {sampled_groups} sampled groups had equal rewards in "
            f"{rounds} rounds; raise max_sampling_rounds or the sampling temperature"
        )
    all_kept = torch.cat(kept_rewards)
    ghost = not kept
    if ghost:
        rollout = replace(spare.rows(torch.zeros(1, dtype=torch.long)), ghost=True)
    else:
        rollout = Rollout.concat(kept)
    mine_at = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    advantages = None
    if advantage is not None:
        advantages = group_advantages(all_kept, group_size, advantage)
        local_adv = torch.zeros(1) if ghost else advantages[mine_at]
        rollout = replace(rollout, advantages=local_adv)
    all_rewards = torch.cat(sampled)
    groups = all_rewards.view(-1, group_size)
    stats = {
        "rollout/reward_mean": float(all_rewards.mean()),
        "rollout/reward_std": float(all_rewards.std(correction=0)),
        "rollout/flat_groups": float(flat_groups(groups).float().mean()),
        "rollout/groups_sampled": float(sampled_groups),
        "rollout/groups_kept": float(len(all_kept) // group_size),
        "rollout/groups_short": float(max(0, num_prompts - len(all_kept) // group_size)),
    }
    if advantages is not None:
        stats["rollout/advantage_abs_mean"] = float(advantages.abs().mean())
    row_means: dict[str, float] = {}
    if len(rollout.reward_parts) > 1:
        row_means.update({f"rollout/{k}": float(v.mean()) for k, v in rollout.reward_parts.items()})
    row_means.update(source.stats(rollout))
    stats.update(_row_weighted_means(world, row_means, 0 if ghost else len(rollout)))
    return replace(rollout, stats=stats), position


def _row_weighted_means(world: World, means: dict[str, float], rows: int) -> dict[str, float]:
    """Per-row means over every rank's rows (each rank's mean weighted by its row count)."""
    if not world.distributed:
        return means
    keys = sorted(means)
    totals = world.sum([means[k] * rows for k in keys] + [rows])
    return {k: totals[i] / max(totals[-1], 1.0) for i, k in enumerate(keys)}


# ------------------------------------------------------------------------------ workflows
@dataclass(frozen=True)
class WorkflowRollout:
    """A captured tree rollout of a workflow: ``run`` (every stage's rows, artefacts and
    traces), ``stages`` (one :class:`Rollout` per stage, with that stage's rewards and
    advantages), ``rewards`` (the final reward of each final-stage row) and ``stats``."""

    run: Any
    stages: dict[str, Rollout]
    rewards: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


def tree_group_sizes(group_size: int, fanouts: Sequence[int]) -> list[int]:
    """The advantage group of each stage of a tree rollout (rows are laid out parent-major):
    the first stage's rows form groups of ``group_size`` (the G samples of a prompt); a later
    stage with fanout K > 1 groups the K children of one parent row; with fanout 1 a row
    shares its parent's group (so K = 1 collapses to one shared advantage)."""
    sizes = [group_size]
    for fanout in fanouts[1:]:
        sizes.append(fanout if fanout > 1 else sizes[-1])
    return sizes


def descendant_means(final_rewards: torch.Tensor, fanouts: Sequence[int]) -> list[torch.Tensor]:
    """Per stage, each row's reward: the mean final reward of its descendants (the final
    stage: its own reward). Rows of every stage are parent-major, so a row's descendants are
    contiguous."""
    means, width = [], 1
    for index in reversed(range(len(fanouts))):
        rows = final_rewards.shape[0] // width
        means.append(final_rewards.view(rows, width).mean(1))
        width *= fanouts[index]
    return list(reversed(means))


def collect_workflow_rollout(
    workflow,
    reward_fn: Callable[[torch.Tensor, list[Any]], Any],
    *,
    start_prompt: int,
    num_prompts: int,
    group_size: int,
    versions: dict[str, int],
    seed: int,
    advantage: AdvantageSpec,
    fanout: dict[str, int] | None = None,
    samplers: dict[str, FlowSamplerConfig] | None = None,
    diagnostics: Callable[[Any], dict[str, float]] | None = None,
    world: World | None = None,
) -> tuple[WorkflowRollout, int]:
    """A tree rollout of ``workflow`` (the stages' rollout weights, at ``versions``) on the
    train prompts ``start_prompt, ...`` of ``workflow.task``: ``group_size`` first-stage
    samples per prompt (seeds :func:`rollout_seed`), each later stage ``fanout`` samples per
    input row, captured. ``reward_fn(final artefacts, examples)`` scores the final stage;
    every stage's rows get the mean final reward of their descendants and group advantages
    within :func:`tree_group_sizes`. ``diagnostics(run)`` adds stats (e.g. a stage-one
    verifier). Returns the rollout and the next prompt position.

    Under several processes (``world``) each rank runs the workflow on its contiguous share of
    the first-stage rows (their descendants follow them) and keeps its rows of every stage;
    final rewards are gathered, so stage rewards, advantages and stats are the whole tree's
    (the same as one process computes), and ``diagnostics`` are averaged over the ranks'
    first-stage rows."""
    world = world or World.current()
    indices = range(start_prompt, start_prompt + num_prompts)
    rows = [(i, g) for i in indices for g in range(group_size)]
    mine = world.share(len(rows), "prompts_per_step × group_size")
    rows = rows[mine]
    examples = [workflow.task.example(i, "train") for i, _ in rows]
    seeds = [rollout_seed(seed, i, g) for i, g in rows]
    run = workflow.run(
        examples,
        seeds,
        capture=True,
        versions=versions,
        samplers=samplers,
        fanout=fanout,
        init_seeds=[rollout_seed(seed, i, 0) for i, _ in rows],  # a prompt group's start noise
    )
    fanout = dict(fanout or {})
    fanouts = [fanout.get(s.name, s.fanout) if s.input else 1 for s in workflow.spec.stages]
    final = run.final
    final_examples = run.examples_of(final.name)
    scored = reward_fn(final.artefact, final_examples)
    local_rewards = scored.total.float()
    rewards = world.gather_rows(local_rewards)  # the whole tree's, parent-major
    sizes = tree_group_sizes(group_size, fanouts)
    stage_rewards = descendant_means(rewards, fanouts)
    stages: dict[str, Rollout] = {}
    width = 1  # rows of a stage per first-stage row
    stats: dict[str, float] = {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std(correction=0)),
    }
    for stage, size, fan, values in zip(workflow.spec.stages, sizes, fanouts, stage_rewards):
        output = run.stages[stage.name]
        width *= fan
        local = slice(mine.start * width, mine.stop * width)
        advantages = group_advantages(values, size, advantage)
        flat = flat_groups(values.view(-1, size)).float().mean()
        parts = dict(scored.parts) if stage.name == final.name else {}
        stages[stage.name] = Rollout(
            trace=output.trace,
            outputs=output.artefact,
            examples=run.examples_of(stage.name),
            rewards=values[local],
            advantages=advantages[local],
            group_size=size,
            reward_parts=parts,
            shard=world.distributed,
            stats={
                "rollout/reward_mean": float(values.mean()),
                "rollout/flat_groups": float(flat),
                "rollout/advantage_abs_mean": float(advantages.abs().mean()),
                "rollout/group_size": float(size),
            },
        )
    means: dict[str, float] = {}
    if len(scored.parts) > 1:
        means.update({f"rollout/{k}": float(v.mean()) for k, v in scored.parts.items()})
    if diagnostics is not None:
        means.update(diagnostics(run))
    stats.update(_row_weighted_means(world, means, len(rows)))
    return WorkflowRollout(run, stages, rewards, stats), start_prompt + num_prompts
