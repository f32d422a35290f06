"""Flow-matching serving vs rollout vs training, side by side in one run.

On one FlowDiT (the flow recipes' default size, or ``--model DIR``), a batch of ``--batch``
mini-GenEval prompts and ``--steps`` sampling steps with classifier-free guidance:

* ``ode_images_per_s``: serving (``sample_flow`` mode ``ode``, no capture);
* ``sde_capture_images_per_s``: rollout (mode ``sde`` with capture: every latent and step
  log-prob recorded); ``rollout_over_serving`` is the time ratio;
* replay cost: the time of one :class:`PolicyLearner` step with the :class:`FlowPolicyPlan`
  (exact replay of every trained
  SDE step with gradient, backward, optimizer step; μ = 1) divided by the number of trained
  steps, against one sampler step (the ODE serving time / ``--steps``); with β = 0 and with
  β > 0 (one more forward per step, for the frozen reference);
* CFG: ``guided_velocity`` (one forward of 2B rows, as the sampler and replay run it) vs two
  forwards of B rows, and the largest difference between their velocities;
* peak memory of each of the three phases, each in a fresh subprocess (see ``MEMORY_METHOD``).

Timings are medians of ``--reps`` repetitions after a warm-up, on ``--clock``: this
process's CPU time by default with one thread on the CPU (the work done, nearly independent
of other processes' load), else wall time; the phases alternate within a repetition so load
drift hits them alike. The one-minute load average before and after is
reported: on a shared machine compare the ratios, not the absolute numbers. Prints one JSON
object as the last line of stdout.

    python benchmarks/flow.py --threads 1
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

from diffusion_rl.advantages import group_advantages
from diffusion_rl.guidance import guided_velocity
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.io import load_model
from diffusion_rl.objectives.flow_grpo import FlowGRPOConfig, FlowGRPOLoss
from diffusion_rl.rollout import Rollout
from diffusion_rl.sampling.flow import FlowSamplerConfig, sample_flow
from diffusion_rl.tasks.geneval import GenEvalTask
from diffusion_rl.train import OptimConfig, Trainer
from diffusion_rl.train.learner import PolicyLearner
from diffusion_rl.train.plans import FlowPolicyPlan
from diffusion_rl.train.roles import PolicyRoles

MEMORY_METHOD = (
    "CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs just before) minus the RSS "
    "before the phase, in a fresh subprocess per phase run with MALLOC_MMAP_THRESHOLD_=65536 "
    "(freed tensors go back to the OS, so RSS tracks live tensors); CUDA: "
    "max_memory_allocated minus the allocation before"
)
PHASES = ("ode", "sde_capture", "learner_step")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a saved FlowDiT directory (default: a fresh one)")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--patch", type=int, default=4)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="images per batch (8 prompts × 8)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        help="what timings measure (default: cpu with one thread on the CPU, else wall)",
    )
    parser.add_argument("--memory-probe", choices=PHASES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_model(args) -> FlowDiT:
    if args.model:
        return load_model(args.model).model.to(args.device)
    torch.manual_seed(args.seed)
    config = FlowDiTConfig(
        image_size=args.image_size, patch_size=args.patch, d_model=args.width, n_layers=args.layers
    )
    return fill_zero_layers(FlowDiT(config)).to(args.device)


def fill_zero_layers(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every all-zero parameter drawn from N(0, 0.02²) in place (a fresh DiT's
    zero-initialised layers make it predict exactly 0, which would time a degenerate model)."""
    with torch.no_grad():
        for param in model.parameters():
            if torch.count_nonzero(param) == 0:
                param.normal_(0.0, 0.02)
    return model


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class Phases:
    """The three timed operations on one model and one batch of prompts."""

    def __init__(self, args, model: FlowDiT) -> None:
        self.args, self.model = args, model
        task = GenEvalTask()
        groups = args.batch // args.group_size
        self.prompts = [
            task.example(i).prompt for i in range(groups) for _ in range(args.group_size)
        ]
        self.seeds = list(range(len(self.prompts)))
        base = dict(num_steps=args.steps, shift=1.0, guidance_scale=args.guidance)
        self.ode = FlowSamplerConfig(**base)
        self.sde = FlowSamplerConfig(**base, mode="sde")
        self.learners = {beta: self._learner(beta) for beta in (0.0, 0.004)}

    def _learner(self, beta: float) -> PolicyLearner:
        def factory(actor, loss_fn):
            return Trainer(
                actor, loss_fn, OptimConfig(lr=1e-6, grad_clip=1.0), device=self.args.device
            )

        roles = PolicyRoles(self.model, reference=beta > 0)
        loss = FlowGRPOLoss(FlowGRPOConfig(beta=beta), reduction=self.sde.reduction)
        return PolicyLearner(roles, FlowPolicyPlan(loss), factory)

    def serve(self, rows: slice = slice(None)):
        return sample_flow(self.model, self.prompts[rows], self.ode, seeds=self.seeds[rows])

    def rollout(self, rows: slice = slice(None), learner: PolicyLearner | None = None):
        learner = learner or self.learners[0.0]
        return sample_flow(
            learner.roles.rollout,
            self.prompts[rows],
            self.sde,
            seeds=self.seeds[rows],
            capture=True,
            weights_version=learner.roles.version,
            group_size=self.args.group_size if rows == slice(None) else None,
        ).trace

    def learner_step(self, beta: float, trace=None) -> int:
        """One learner step on a fresh rollout (not timed here); returns the trained steps."""
        learner = self.learners[beta]
        trace = trace if trace is not None else self.rollout(learner=learner)
        rewards = trace.latents[:, -1].float().mean((1, 2, 3))
        spec = learner.plan.objective.config.advantage_spec
        advantages = group_advantages(rewards, self.args.group_size, spec)
        trained = learner.plan.trained_steps(trace, learner.rollout_step)
        # the final latents stand in for the images: the learner reads trace and advantages
        rollout = Rollout(
            trace,
            trace.latents[:, -1],
            list(trace.prompts),
            rewards,
            advantages,
            self.args.group_size,
        )
        learner.step(rollout)
        return len(trained)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, device, clock: str) -> tuple[float, object]:
    """Seconds of ``fn()`` on ``clock``: wall time, or this process's CPU time (with one
    thread on a shared CPU that is the work done, whatever the load)."""
    now = CLOCKS[clock]
    synchronize(device)
    start = now()
    out = fn()
    synchronize(device)
    return now() - start, out


def environment(device, load_before: float) -> dict:
    """The report's ``environment``: versions, device, threads, CPUs and the 1-minute load
    average before the run (``load_before``) and now."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def memory_probe(args) -> dict:
    """In a fresh process: the peak memory of one phase on the full batch."""
    model = build_model(args)
    phases = Phases(args, model)
    device = torch.device(args.device)
    run = {
        "ode": lambda: phases.serve(),
        "sde_capture": lambda: phases.rollout(),
        "learner_step": lambda: phases.learner_step(0.0, trace),
    }[args.memory_probe]
    if args.memory_probe == "learner_step":
        phases.learner_step(0.0)  # warm-up (and the optimizer's state, which persists)
        trace = phases.rollout()  # the rollout is not part of the step's peak
    else:
        run()  # warm-up: pages in the kernels' code; its tensors are freed
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        synchronize(device)
        return {"peak_mib": round((torch.cuda.max_memory_allocated(device) - before) / 2**20, 1)}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_kib("VmRSS")
    run()
    return {"peak_mib": round((proc_status_kib("VmHWM") - before) / 1024, 1)}


def proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def measure_memory(argv: list[str]) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    peaks = {}
    for phase in PHASES:
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--memory-probe", phase]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        peaks[phase] = json.loads(out.strip().splitlines()[-1])["peak_mib"]
        log(f"peak memory {phase}: {peaks[phase]} MiB")
    return peaks


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.batch % args.group_size:
        raise SystemExit(
            f"--batch {args.batch} must be a multiple of --group-size {args.group_size}"
        )
    if args.memory_probe is not None:
        return memory_probe(args)
    device = args.device
    clock = args.clock or (
        "cpu" if torch.device(device).type == "cpu" and torch.get_num_threads() == 1 else "wall"
    )
    load_before = os.getloadavg()[0]
    model = build_model(args)
    phases = Phases(args, model)
    log(
        f"FlowDiT {model.num_parameters():,} parameters on {device}, {torch.get_num_threads()} threads"
    )

    # CFG: one forward of 2B rows (what sampler and replay run) vs two forwards of B rows.
    x = torch.randn(args.batch, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    x, sigma = x.to(device), torch.full((args.batch,), 0.5, device=device)
    cond, uncond = model.encode_prompts(phases.prompts), model.empty_condition(args.batch)

    @torch.no_grad()
    def cfg_batched():
        return guided_velocity(model, x, sigma, cond, uncond, args.guidance)

    @torch.no_grad()
    def cfg_two_forwards():
        v_cond, v_uncond = model(x, sigma, cond).float(), model(x, sigma, uncond).float()
        return v_uncond + args.guidance * (v_cond - v_uncond)

    # warm-up on a few rows / once
    phases.serve(slice(0, 2))
    phases.rollout(slice(0, 2))
    phases.learner_step(0.0)
    phases.learner_step(0.004)
    cfg_batched(), cfg_two_forwards()

    names = ("ode", "sde_capture", "learner_beta0", "learner_beta", "cfg_batched", "cfg_two")
    times: dict[str, list[float]] = {name: [] for name in names}
    trained = 0
    for rep in range(args.reps):
        times["ode"].append(timed(phases.serve, device, clock)[0])
        times["sde_capture"].append(timed(phases.rollout, device, clock)[0])
        for beta, name in ((0.0, "learner_beta0"), (0.004, "learner_beta")):
            trace = phases.rollout(learner=phases.learners[beta])
            step = functools.partial(phases.learner_step, beta, trace)
            seconds, trained = timed(step, device, clock)
            times[name].append(seconds)
        times["cfg_batched"].append(timed(cfg_batched, device, clock)[0])
        times["cfg_two"].append(timed(cfg_two_forwards, device, clock)[0])
        log(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {times[n][-1]:.3f}s" for n in names))
    median = {name: statistics.median(values) for name, values in times.items()}
    cfg_delta = float((cfg_batched() - cfg_two_forwards()).abs().max())

    sampler_step = median["ode"] / args.steps
    memory = measure_memory(argv) if args.memory else None
    report = {
        "benchmark": "flow",
        "clock": clock,
        "ode_images_per_s": round(args.batch / median["ode"], 1),
        "sde_capture_images_per_s": round(args.batch / median["sde_capture"], 1),
        "rollout_over_serving": round(median["sde_capture"] / median["ode"], 3),
        "sampler_step_s": round(sampler_step, 5),
        "replay_per_trained_step_s": {
            "beta_0": round(median["learner_beta0"] / trained, 5),
            "beta_0.004": round(median["learner_beta"] / trained, 5),
        },
        "replay_over_sampler_step": {
            "beta_0": round(median["learner_beta0"] / trained / sampler_step, 3),
            "beta_0.004": round(median["learner_beta"] / trained / sampler_step, 3),
        },
        "trained_steps_per_learner_step": trained,
        "cfg_batched_s": round(median["cfg_batched"], 5),
        "cfg_two_forwards_s": round(median["cfg_two"], 5),
        "cfg_two_over_batched": round(median["cfg_two"] / median["cfg_batched"], 3),
        "cfg_max_abs_delta": cfg_delta,
        "peak_memory_mib": memory,
        "memory_method": MEMORY_METHOD if memory else None,
        "peak_rss_mib_main_process": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
        ),
        "settings": {
            "batch": args.batch,
            "group_size": args.group_size,
            "steps": args.steps,
            "guidance_scale": args.guidance,
            "noise_level": phases.sde.noise_level,
            "reps": args.reps,
            "seed": args.seed,
        },
        "seconds": {name: [round(t, 4) for t in values] for name, values in times.items()},
        "model": {
            "path": args.model,
            "image_size": model.config.image_size,
            "patch_size": model.config.patch_size,
            "d_model": model.config.d_model,
            "n_layers": model.config.n_layers,
            "parameters": model.num_parameters(),
        },
        "environment": environment(device, load_before),
    }
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
