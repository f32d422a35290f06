"""Recipe configs: bad values and YAML errors give one-line errors naming the key (or the file,
line and column), limits, devices, rewards against tasks, the LR schedule over ``steps``, the
shipped configs and the printed (re-loadable) effective config."""

import math
import re
import time
from pathlib import Path

import pytest
import torch
import yaml

from diffusion_rl import config as config_module
from diffusion_rl.config import (
    LIMITS,
    TASK_REWARDS,
    ConfigError,
    DistillRecipeConfig,
    FlowGRPORecipeConfig,
    FlowModelSection,
    FlowSFTRecipeConfig,
    GRPORecipeConfig,
    ModelSection,
    RewardSection,
    SFTRecipeConfig,
    build_config,
    check_device,
    check_rewards_for_task,
    config_to_yaml,
    flow_model_size,
    load_config,
    parse_overrides,
    token_model_size,
)
from diffusion_rl.models.dit import FlowDiT, FlowDiTConfig
from diffusion_rl.models.transformer import DiffusionTransformer, TransformerConfig
from diffusion_rl.rewards import REWARDS, get_reward
from diffusion_rl.rollout import rollout_seed
from diffusion_rl.tasks import get_task
from diffusion_rl.train.learner import _KEY_MIX
from diffusion_rl.train.trainer import lr_factor

CONFIGS = Path(__file__).parents[1] / "configs"
S, G, D = SFTRecipeConfig, GRPORecipeConfig, DistillRecipeConfig
FS, FG = FlowSFTRecipeConfig, FlowGRPORecipeConfig
RECIPES = [S, G, D, FS, FG]
SHIPPED = [
    ("sft_arithmetic.yaml", S),
    ("grpo_arithmetic.yaml", G),
    ("distill_arithmetic.yaml", D),
    ("flow_sft_geneval.yaml", FS),
    ("flow_grpo_geneval.yaml", FG),
]


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch):
    """Every test sees a machine without CUDA (so 'cuda' is refused on any test machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ----------------------------------------------------------------------------- bad values
# (config class, dotted key, YAML value, the key the error must name when not the given one)
BAD_VALUES = [
    # run fields
    (S, "steps", "true", None),
    (S, "steps", "1.5", None),
    (S, "steps", "0", None),
    (S, "steps", "-3", None),
    (S, "steps", "2000000000", None),
    (S, "steps", "'10'", None),
    (S, "checkpoint_every", "1.0e3", None),
    (G, "seed", "-1", None),
    (G, "seed", "1180591620717411303424", None),  # 2**70
    (D, "seed", "4294967296", None),  # 2**32
    (FS, "seed", "true", None),
    (S, "output_dir", "''", None),
    (FG, "output_dir", "'  '", None),
    (D, "output_dir", "3", None),
    (S, "device", "cuda", None),
    (G, "device", "gpu", None),
    (FS, "device", "cuda:x", None),
    (D, "device", "CPU", None),
    (FG, "device", "cuda:0", None),
    (FG, "offload_device", "tpu", None),
    (G, "offload_device", "cuda", None),
    (S, "threads", "0", None),
    (G, "threads", "5000", None),
    (S, "precision", "fp16", None),
    (FS, "resume", "1", None),
    (G, "keep_last", "0", None),
    (D, "eval_every", "false", None),
    (FG, "log_every", "0", None),
    (S, "max_consecutive_skips", "-1", None),
    (G, "wandb_project", "''", None),
    (S, "stepz", "3", None),
    # sections given as something else than a mapping
    (S, "optim", "[]", None),
    (G, "optim", "3", None),
    (D, "sampler", "fast", None),
    (FS, "model", "[]", None),
    (FG, "policy", "true", None),
    (S, "task", "[]", None),
    (G, "task", "5", None),
    (FS, "task", "[geneval]", None),
    (G, "rewards", "{name: digits}", None),
    (G, "rewards", "[3]", "rewards.0"),
    (FG, "rewards", "[]", None),
    # optimiser
    (S, "optim.lr", ".inf", None),
    (G, "optim.lr", ".nan", None),
    (D, "optim.lr", "0", None),
    (FS, "optim.lr", "-1e-3", None),
    (FG, "optim.lr", "fast", None),
    (S, "optim.weight_decay", "-0.1", None),
    (G, "optim.betas", "[0.9]", "optim.betas.1"),  # the missing second beta
    (D, "optim.betas", "[0.9, 1.0]", None),
    (FS, "optim.betas", "[true, 0.9]", None),
    (S, "optim.eps", ".inf", None),
    (G, "optim.grad_clip", "0", None),
    (D, "optim.schedule", "exponential", None),
    (S, "optim.warmup_steps", "-1", None),
    (FS, "optim.warmup_steps", "5000", None),  # > total_steps = steps = 3000
    (G, "optim.total_steps", "0", None),
    (S, "optim.total_steps", "-5", None),
    (S, "optim.min_lr_ratio", "1.5", None),
    (S, "optim.lrr", "0.1", None),
    (FG, "optim.sheduel", "cosine", None),
    # token sampler
    (S, "sampler.generation_length", "0", None),
    (G, "sampler.generation_length", "100000000", None),
    (D, "sampler.block_size", "true", None),
    (S, "sampler.block_size", "5000", None),  # > the task's block size limit, 4096
    (S, "sampler.steps_per_block", "9", None),
    (G, "sampler.temperature", "-1", None),
    (D, "sampler.temperature", ".inf", None),
    (S, "sampler.threshold", "1.5", None),
    (G, "sampler.confidence", "max", None),
    (D, "sampler.use_cache", "'on'", None),
    (S, "sampler.stop_at_eos", "0", None),
    # flow sampler
    (FS, "sampler.num_steps", "0", None),
    (FG, "sampler.num_steps", "100000", None),
    (FS, "sampler.shift", "0", None),
    (FG, "sampler.guidance_scale", ".inf", None),
    (FG, "sampler.noise_level", "-0.5", None),
    (FS, "sampler.mode", "sde", None),
    (FG, "sampler.mode", "ode", None),
    (FG, "sampler.sde_window", "[3, 2]", None),
    (FG, "sampler.sde_window", "[0, true]", None),
    (FS, "sampler.latent_dtype", "float16", None),
    (FG, "sampler.kernels", "{bogus_op: reference}", None),
    (FS, "sampler.micro_batch_size", "0", None),
    # models
    (S, "model.d_model", "0", None),
    (S, "model.d_model", "100000", None),
    (S, "model.d_model", "32768", "model"),  # within the key's limit, but ~5e10 parameters
    (S, "model.n_layers", "5000", None),
    (S, "model.n_heads", "5", None),
    (S, "model.d_ff", "-4", None),
    (S, "model.attention", "causal", None),
    (S, "model.kind", "video", None),
    (S, "model.path", "''", None),
    (G, "model.path", "''", None),
    (D, "teacher.path", "''", None),
    (D, "student.kind", "image", None),
    (FS, "model.patch_size", "5", None),
    (FS, "model.mlp_ratio", ".nan", None),
    (FS, "model.n_heads", "7", None),
    (FS, "model.d_model", "30000", "model"),
    # tasks
    (S, "task.num_digits", "0", None),
    (S, "task.num_digits", "100", None),
    (S, "task.num_digitz", "2", None),
    (S, "task.operations", "'*'", None),
    (S, "task.name", "sudoku9", None),
    (S, "task.block_size", "8", None),
    (S, "task.completion_length", "3", "task"),
    (G, "task.name", "geneval", None),
    (D, "task.seed", "-1", None),
    (FS, "task.image_size", "8", None),
    (FS, "task.kinds", "[shape]", "task.kinds.0"),
    (FS, "task.heldout_fraction", "0.7", None),
    (FS, "task.max_count", "true", None),
    (FS, "task.min_area", "0", None),
    (FG, "task.name", "arithmetic", None),
    # objectives
    (S, "objective.eps", "1.0", None),
    (S, "objective.weighting", "inverse", None),
    (G, "policy.clip_low", "1.0", None),
    (G, "policy.beta", "-1", None),
    (G, "policy.beta", "true", None),
    (G, "policy.algorithm", "ppo", None),
    (G, "policy.std_ddof", "2", None),
    (G, "policy.num_iterations", "0", None),
    (G, "policy.kl_estimator", "k4", None),
    (D, "objective.temperature", "0", None),
    (D, "objective.soft_weight", ".inf", None),
    (D, "objective.hard_weight", "-1", None),
    (FS, "objective.cond_dropout", "1.0", None),
    (FS, "objective.logit_std", "0", None),
    (FG, "policy.clip_range", "2.0", None),
    (FG, "policy.timestep_fraction", "0", None),
    (FG, "policy.beta", ".inf", None),
    # rewards
    (G, "rewards", "[{name: countdown, options: {use_al: true}}]", "rewards.0.options"),
    (G, "rewards", "[{name: sudoku, options: {mode: rows}}]", "rewards.0.options"),
    (G, "rewards", "[{name: geneval}]", "rewards.0.name"),
    (G, "rewards", "[{name: digitz}]", "rewards.0.name"),
    (G, "rewards", "[{name: verifier, weight: -1}]", "rewards.0.weight"),
    (G, "rewards", "[{name: verifier, weight: .nan}]", "rewards.0.weight"),
    (G, "rewards", "[{name: digits, options: {x: 1}}]", "rewards.0.options"),
    (G, "rewards", "[{name: verifier}, {name: verifier}]", None),
    (G, "rewards", "[{name: math, options: {timeout_seconds: 0}}]", "rewards.0.options"),
    (G, "rewards", "[{nme: verifier}]", "rewards.0.nme"),
    (FG, "rewards", "[{name: verifier}]", "rewards.0"),
    (FG, "rewards", "[{name: geneval, options: {modee: all}}]", "rewards.0.options"),
    (FG, "rewards", "[{name: compressibility, options: {quality: 500}}]", "rewards.0"),
    (FG, "rewards", "[{name: geneval}, {name: geneval}]", None),
    # recipe fields
    (G, "sequence_packing", "true", None),
    (G, "group_size", "1", None),
    (FG, "group_size", "5000", None),
    (G, "prompts_per_step", "70000", None),
    (G, "prompts_per_step", "10000", None),  # x group_size 8 = 80000 rollout rows per step
    (G, "scorer", "approx", None),
    (G, "eval_temperature", "-1", None),
    (G, "post_stop_weight", ".inf", None),
    (G, "max_sampling_rounds", "0", None),
    (G, "micro_batch_size", "0", None),
    (D, "samples_per_prompt", "0", None),
    (D, "prompts_per_step", "100000", None),
    (FG, "ema_decay", "1.0", None),
    (FG, "eval_samples_per_prompt", "0", None),
    (FS, "grid_images", "5000", None),
    (FS, "batch_size", "100000", None),
    (S, "eval_examples", "0", None),
    (S, "batch_size", "true", None),
    (S, "micro_batch_size", "1.5", None),
    (S, "activation_checkpointing", "'no'", None),
    (FG, "allow_off_policy", "2", None),
]


def nested_yaml(dotted: str, value: str) -> str:
    """``a.b: v`` as block YAML (``a:\\n  b: v``), the value text kept verbatim."""
    keys = dotted.split(".")
    lines = [f"{'  ' * depth}{key}:" for depth, key in enumerate(keys[:-1])]
    lines.append(f"{'  ' * (len(keys) - 1)}{keys[-1]}: {value}")
    return "\n".join(lines) + "\n"


def assert_one_problem(message: str, source: str, key: str) -> None:
    """The ConfigError's first line names the source; then exactly one problem line, one
    line long, starting with the dotted key."""
    lines = message.split("\n")
    assert lines[0] == f"{source}: invalid config", message
    assert len(lines) == 2, message
    assert lines[1].startswith(f"  {key}: "), message
    assert len(lines[1].strip()) > len(key) + 2


def case_id(case) -> str:
    cls, key, value, _ = case
    return f"{cls.__name__}-{key}={value}"


@pytest.mark.parametrize("case", BAD_VALUES, ids=case_id)
def test_a_bad_value_in_a_file_names_its_key(tmp_path, case):
    cls, key, value, shown = case
    path = tmp_path / "bad.yaml"
    path.write_text(nested_yaml(key, value))
    with pytest.raises(ConfigError) as info:
        load_config(path, cls)
    assert_one_problem(str(info.value), str(path), shown or key)


@pytest.mark.parametrize("case", BAD_VALUES, ids=case_id)
def test_a_bad_value_from_set_names_its_key(case):
    cls, key, value, shown = case
    with pytest.raises(ConfigError) as info:
        load_config(None, cls, [f"{key}={value}"])
    assert_one_problem(str(info.value), "defaults with --set overrides", shown or key)


def test_messages_say_what_is_wrong():
    def problem(cls, *sets):
        with pytest.raises(ConfigError) as info:
            load_config(None, cls, list(sets))
        return str(info.value).split("\n", 1)[1].strip()

    assert problem(S, "optim=[]") == "optim: expected a mapping of keys, got a list"
    assert problem(S, "optim.lr=.inf") == (
        "optim.lr: expected a finite number, not .nan or .inf (got .inf)"
    )
    assert problem(S, "optim.lrr=1") == "optim.lrr: unknown key; did you mean 'lr'?"
    assert problem(S, "steps=true") == "steps: expected an integer (got true)"
    assert problem(S, "seed=1180591620717411303424") == (
        f"seed: 1180591620717411303424 exceeds the limit {2**32 - 1} (LIMITS)"
    )
    assert problem(S, "output_dir=''") == "output_dir: expected a non-empty path, got ''"
    cuda = problem(S, "device=cuda")
    assert cuda.startswith("device: 'cuda': ") and "no CUDA" in cuda
    assert problem(S, "sampler.steps_per_block=9").startswith(
        "sampler.steps_per_block: the fixed schedule commits >= 1 slot per step"
    )
    assert problem(G, "policy.beta=true") == (
        "policy.beta: expected a number, or expected 'none' (got true)"
    )
    assert problem(S, "task.num_digitz=2") == (
        "task.num_digitz: unknown key; did you mean 'num_digits'?"
    )
    assert problem(S, "stepz=1") == "stepz: unknown key; did you mean 'steps'?"
    assert problem(FG, "optim.sheduel=cosine") == (
        "optim.sheduel: unknown key; did you mean 'schedule'?"
    )
    assert problem(S, "zzz=1") == (  # no list of every valid key: output stays bounded
        "zzz: unknown key; remove it or check its spelling (--print-config lists every valid key)"
    )
    # the texts tests/test_recipes.py and tests/test_flow_recipes.py match stay as they were
    assert problem(FG, "rewards=[{name: verifier}]").startswith(
        "rewards.0: name 'verifier' is not an image reward"
    )
    assert problem(FG, "rewards=[{name: geneval, options: {mode: x}}]").startswith(
        "rewards.0: GenEvalReward.mode: expected 'mean' or 'all'"
    )


def test_several_problems_are_one_line_each(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("stepz: 3\nseed: -1\noptim:\n  lr: .inf\n  lrr: 2\nmodel:\n  d_modle: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, SFTRecipeConfig)
    lines = str(info.value).split("\n")
    assert lines[0] == f"{path}: invalid config"
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == [
        "model.d_modle",
        "optim.lr",
        "optim.lrr",
        "seed",
        "stepz",
    ]


# ----------------------------------------------------------------------------- YAML syntax
# (file text, "line:column" the error must point at)
SYNTAX_ERRORS = [
    ("steps: 3\noptim:\n  lr: [1\n", "4:1"),
    ("steps: 3\nsteps: 4\n", "2:1"),  # duplicate key: a later value would silently win
    ("optim:\n  lr: 1e-3\n  lr: 2\n", "3:3"),
    ("steps: 3\n\tseed: 1\n", "2:1"),
    ("a: b: c\n", "1:5"),
    ('output_dir: "runs\n', "2:1"),
    ("optim:\n  lr: 1\n bad: 2\n", "3:2"),
    ("steps: 3\n- 4\n", "2:1"),
    ("{steps: 3\n", "2:1"),
    ("steps: *undefined\n", "1:8"),
    ("? [a, b]\n: 1\n", "1:3"),
    ("steps: !!python/object/apply:os.system [echo]\n", "1:8"),
    ("seed: 1\nx: '\x01'\n", "2:5"),
    ("%YAML 3.0\n---\nsteps: 1\n", "1:1"),
]


@pytest.mark.parametrize(("text", "where"), SYNTAX_ERRORS)
def test_yaml_errors_are_one_line_with_file_line_and_column(tmp_path, text, where):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, SFTRecipeConfig)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{where}: "), message
    assert len(message) > len(f"{path}:{where}: ") + 5


def test_file_level_errors_name_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"steps: 3\noutput_dir: caf\xe9\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:2:16: not UTF-8 text")):
        load_config(path, SFTRecipeConfig)
    path = tmp_path / "list.yaml"
    path.write_text("- steps\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, SFTRecipeConfig)
    assert str(info.value) == f"{path}: expected a mapping of keys at the top level, got a list"
    with pytest.raises(ConfigError, match="is a directory, not a regular file"):
        load_config(tmp_path, SFTRecipeConfig)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing set\n")
    assert load_config(empty, SFTRecipeConfig) == SFTRecipeConfig()


# (--set item, what the one-line error must contain)
BAD_OVERRIDES = [
    ("optim.lr=[1", "not valid YAML at column 3"),
    ("optim.lr={a", "not valid YAML at column 3"),
    ('output_dir="runs', "not valid YAML at column 6"),
    ("steps=a: b: c", "not valid YAML at column 5"),
    ("optim.lr=*x", "not valid YAML at column 1"),
    ("=3", "'' is not a key"),
    ("optim..lr=3", "'' is not a key"),
    ("a b=3", "'a b' is not a key"),
    ("steps", "expected KEY=VALUE"),
    ("steps=3 extra=1", None),  # parses as the string '3 extra=1': a value error
]


@pytest.mark.parametrize(("item", "expected"), BAD_OVERRIDES)
def test_bad_overrides_are_one_line_errors(item, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, SFTRecipeConfig, [item])
    message = str(info.value)
    if expected is None:
        assert_one_problem(message, "defaults with --set overrides", "steps")
        return
    assert "\n" not in message and repr(item) in message and expected in message


def test_yaml_12_exponents_are_numbers_and_printed_strings_stay_strings(tmp_path):
    assert parse_overrides(["optim.lr=3e-4", "x=1E5", "y=-2e+3"]) == {
        "optim": {"lr": 3e-4},
        "x": 1e5,
        "y": -2e3,
    }
    config = load_config(None, SFTRecipeConfig, ["output_dir='1e3'", "optim.lr=5e-4"])
    assert config.output_dir == "1e3" and config.optim.lr == 5e-4
    path = tmp_path / "printed.yaml"
    path.write_text(config_to_yaml(config))
    assert "output_dir: '1e3'" in path.read_text()  # quoted, or it would read back as 1000.0
    assert load_config(path, SFTRecipeConfig) == config


# ----------------------------------------------------------------------------- limits, devices
def test_the_seed_limit_is_what_the_derived_seeds_allow():
    """The learner keys micro-batch generators (seed * _KEY_MIX + step) * 4096 + index (below
    2**64 for manual_seed) and rollout seeds must fit the traces' int64 seeds column: both
    hold at the largest accepted seed and the largest step, and break just above 2**32."""
    top = LIMITS["seed"]
    assert load_config(None, GRPORecipeConfig, [f"seed={top}"]).seed == top
    steps, rows = LIMITS["steps"], LIMITS["rows_per_step"]
    torch.Generator().manual_seed((top * _KEY_MIX + steps) * 4096 + 4095)
    assert rollout_seed(top, steps * rows, 63) < 2**63
    with pytest.raises((RuntimeError, ValueError), match="Overflow"):
        torch.Generator().manual_seed((2**33 * _KEY_MIX + steps) * 4096)


def test_devices(monkeypatch):
    assert check_device("cpu") == "cpu"
    for bad in ("gpu", "cuda:", "cuda:-1", "CPU", "cuda0", ""):
        with pytest.raises(ValueError, match="expected 'cpu', 'cuda', 'cuda:N' or 'mps'"):
            check_device(bad)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="'cuda': this build of PyTorch has no CUDA; use 'cpu'"):
        check_device("cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        check_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda") == "cuda" and check_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        check_device("cuda:2")
    config = load_config(None, GRPORecipeConfig, ["device=cuda:1", "offload_device=cpu"])
    assert (config.device, config.offload_device) == ("cuda:1", "cpu")


@pytest.mark.parametrize(
    ("d_model", "n_layers", "d_ff", "vocab", "positions"),
    [(128, 4, None, 16, 16), (64, 2, 100, 16, 12), (256, 3, None, 30, 40)],
)
def test_the_token_model_estimate_matches_the_model(d_model, n_layers, d_ff, vocab, positions):
    section = ModelSection(d_model=d_model, n_layers=n_layers, n_heads=4, d_ff=d_ff)
    model = DiffusionTransformer(
        TransformerConfig(
            vocab_size=vocab,
            mask_token_id=vocab - 1,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=4,
            d_ff=d_ff,
            max_seq_len=positions,
        )
    )
    actual = sum(p.numel() for p in model.parameters())
    estimate, activations = token_model_size(section, vocab, positions, rows=8)
    assert abs(estimate - actual) <= 0.02 * actual
    assert activations == 8 * positions * max(d_ff or 4 * d_model, 3 * d_model) * n_layers


@pytest.mark.parametrize(
    ("d_model", "n_layers", "mlp_ratio", "patch", "image"),
    [(96, 4, 4.0, 4, 16), (64, 2, 2.0, 2, 32), (32, 1, 3.0, 4, 12)],
)
def test_the_flow_model_estimate_matches_the_model(d_model, n_layers, mlp_ratio, patch, image):
    section = FlowModelSection(
        d_model=d_model, n_layers=n_layers, n_heads=4, mlp_ratio=mlp_ratio, patch_size=patch
    )
    model = FlowDiT(
        FlowDiTConfig(
            image_size=image,
            patch_size=patch,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=4,
            mlp_ratio=mlp_ratio,
        )
    )
    actual = sum(p.numel() for p in model.parameters())
    estimate, _ = flow_model_size(section, image, len(model.config.vocabulary), rows=4)
    assert abs(estimate - actual) <= 0.02 * actual


def test_configs_asking_for_terabytes_are_refused_at_once():
    """Each asks for far more memory than any machine has; each is refused in config
    validation (no allocation: well under a second), naming what is too large."""
    cases = [
        (S, ["model.d_model=32768", "model.n_layers=1024"], "model: too large a new model"),
        (S, ["model.d_model=4096", "batch_size=65536"], "activation elements per forward"),
        (FS, ["model.d_model=16384", "model.n_layers=64"], "model: too large a new model"),
        (G, ["prompts_per_step=65536", "group_size=4096"], "prompts_per_step: prompts x group"),
        (D, ["prompts_per_step=65536", "samples_per_prompt=4096"], "prompts_per_step:"),
        (S, ["sampler.generation_length=1000000000"], "exceeds the limit 65536"),
    ]
    for cls, sets, expected in cases:
        start = time.perf_counter()
        with pytest.raises(ConfigError) as info:
            load_config(None, cls, sets)
        assert time.perf_counter() - start < 1.0
        assert expected in str(info.value)
    # the generous side: the limits leave room far beyond the built-in sizes
    big = load_config(None, S, ["model.d_model=2048", "model.n_layers=24", "model.n_heads=16"])
    assert token_model_size(big.model, 16, 16, 64)[0] > 1e9


# ----------------------------------------------------------------------------- hostile input
def _unknown_keys(count: int) -> str:
    return "".join(f"k{i}: 1\n" for i in range(count))


def _alias_bomb() -> str:  # "billion laughs": 10**9 strings once aliases are expanded
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def _merge_chain(count: int) -> str:  # each mapping merges the previous one: n**2 / 2 keys
    lines = ["m0: &m0 {k0: 1}"]
    lines += [f"m{i}: &m{i} {{<<: *m{i - 1}, k{i}: 1}}" for i in range(1, count)]
    return "\n".join(lines) + "\n"


# (how the input is given, the text, what the one error line must contain)
HOSTILE_INPUTS = {
    "brackets 100 000 deep": ("file", "steps: " + "[" * 100_000 + "]" * 100_000, ":1:41: nested deeper than 32 levels"),
    "mappings 200 deep": ("file", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "x: 1", ":32:63: nested deeper than 32 levels"),
    "a 100 000-digit integer": ("file", "steps: " + "1" * 100_000, ":1:8: steps: an integer of 100000 digits; at most 64"),
    "a 100 000-digit hex integer": ("file", "seed: 0x" + "f" * 100_000, ":1:7: seed: an integer of 100002 digits"),
    "an integer in a list": ("file", "rewards: [" + "9" * 5000 + "]", ":1:11: an integer of 5000 digits"),
    "an alias bomb": ("file", _alias_bomb(), ": more than 10000 values (aliases expanded)"),
    "an alias of itself": ("file", "steps: &a [*a]", ": nested deeper than 32 levels of mappings and lists (aliases expanded)"),
    "a chain of merge keys": ("file", _merge_chain(2000), ": more than 10000 keys (merge keys '<<' expanded)"),
    "200 000 unknown keys": ("file", _unknown_keys(200_000), ": larger than 256 KiB, the limit of a config file"),
    "20 000 unknown keys": ("file", _unknown_keys(20_000), ":7500:7: more than 30000 YAML tokens"),
    "a flow mapping of 12 000 keys": ("file", "{" + ", ".join(f"{i}: 1" for i in range(12_000)) + "}", ": more than 30000 YAML tokens"),
    "3 000 unknown keys": ("file", _unknown_keys(3_000), "  ... and 2990 more problems"),
    "a 100 000-character key": ("file", "k" * 100_000 + ": 1", ":1:100001: mapping values are not allowed here"),
    "--set brackets 30 000 deep": ("set", "steps=" + "[" * 30_000 + "]" * 30_000, "nested deeper than 32 levels"),
    "--set a 100 000-digit integer": ("set", "steps=" + "1" * 100_000, "the value is not valid YAML at column 1: an integer of 100000 digits"),
    "--set a key 5 000 deep": ("set", "a." * 5_000 + "b=1", "the key nests 5001 levels; at most 31"),
    "--set a 1 MB value": ("set", "output_dir=" + "x" * 1_000_000, "the value is longer than 256 KiB"),
}  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE_INPUTS, ids=list(HOSTILE_INPUTS))
def test_any_config_input_is_answered_quickly_in_one_bounded_line(case, tmp_path, capsys):
    """Every input a config can be (nesting, numbers, aliases, sizes, unknown keys) is
    answered within < 100 MB of allocations, with < 2 KB of stderr: one line naming the file
    (line and column, or key), or a few for many problems; exit status 2. (Its time, < 2 s,
    is measured by benchmarks/cli_start.py, not here.)"""
    import tracemalloc

    from diffusion_rl import cli

    how, text, expected = HOSTILE_INPUTS[case]
    argv = ["sft"]
    if how == "file":
        path = tmp_path / "hostile.yaml"
        path.write_text(text + "\n")
        argv += ["--config", str(path)]
    else:
        argv += ["--set", text]
    status = cli.main(argv)
    err = capsys.readouterr().err
    tracemalloc.start()  # again, counting allocations (which slows it down)
    try:
        assert cli.main(argv) == status
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert capsys.readouterr().err == err
    assert status == 2, err
    assert expected in err, err
    if how == "file":
        assert str(path) in err.splitlines()[0]
    assert len(err.encode()) < 2048 and len(err.splitlines()) <= 12 and "Traceback" not in err
    assert peak < 100 * 2**20, peak


def test_many_unknown_keys_list_a_few_and_count_the_rest():
    with pytest.raises(ConfigError) as info:
        load_config(None, S, [f"optim.lr{i}=1" for i in range(50)] + ["stepz=1", "zz=1"])
    lines = str(info.value).splitlines()
    assert len(lines) == 12 and lines[-1] == "  ... and 42 more problems"
    assert lines[1] == "  optim.lr0: unknown key; did you mean 'lr'?"
    assert all(len(line) <= 300 for line in lines)
    with pytest.raises(ConfigError) as info:  # at most three close names
        load_config(None, G, ["policy.bet=1"])
    assert "policy.bet: unknown key; did you mean 'beta'" in str(info.value)


# ----------------------------------------------------------------------------- rewards vs tasks
def test_the_task_reward_table_is_what_the_rewards_need():
    """Each reward listed for arithmetic scores a right answer 1 and a wrong one 0 on real
    arithmetic examples; every other text reward fails on them (it reads fields arithmetic
    examples do not have); every registered text reward is one or the other."""
    task = get_task("arithmetic", num_digits=2, operations="+-")
    examples = task.examples(range(6), "eval")
    right = [e.answer for e in examples]
    wrong = [str(int(e.answer) + 1) for e in examples]
    image = set(config_module.IMAGE_REWARDS) | set(config_module.VIDEO_REWARDS)
    text = sorted(set(REWARDS) - image)
    for name in text:
        reward = get_reward(name, task=task) if name in ("verifier", "digits") else None
        reward = reward or get_reward(name)
        if name in TASK_REWARDS["arithmetic"]:
            assert reward(right, examples).tolist() == [1.0] * 6
            assert max(reward(wrong, examples).tolist()) < 1.0
        else:
            with pytest.raises((TypeError, ValueError)):
                reward(right, examples)
    assert set(text) == set(TASK_REWARDS["arithmetic"]) | set(config_module._REWARD_NEEDS)


def test_rewards_are_checked_against_the_task():
    check_rewards_for_task([RewardSection(name="digits"), "verifier"], "arithmetic")
    with pytest.raises(ConfigError) as info:
        check_rewards_for_task(
            [RewardSection(name="verifier"), RewardSection(name="countdown"), "sudoku"],
            "arithmetic",
        )
    assert str(info.value).split("\n") == [
        "rewards.1.name: 'countdown' does not apply to the arithmetic task (it needs examples "
        "with 'numbers' and 'target'); rewards that apply: verifier, digits, math",
        "rewards.2.name: 'sudoku' does not apply to the arithmetic task (it needs examples "
        "with a 'puzzle'); rewards that apply: verifier, digits, math",
    ]
    with pytest.raises(ConfigError, match="rewards.0.name: 'verifier' does not apply to the "):
        check_rewards_for_task(["verifier"], "a_task_of_a_later_version")
    # at config time: with the task given, and with task null (any built-in text task)
    config = load_config(None, G, ["task.name=arithmetic", "rewards=[{name: digits}]"])
    assert [r.name for r in config.rewards] == ["digits"]
    with pytest.raises(ConfigError, match="rewards.0.name: 'countdown' does not apply to the "):
        load_config(None, G, ["task.name=arithmetic", "rewards=[{name: countdown}]"])
    # task null: a reward of any built-in text task passes (the recipe checks the model's task)
    config = load_config(None, G, ["rewards=[{name: countdown}]"])
    assert [r.name for r in config.rewards] == ["countdown"]
    with pytest.raises(
        ConfigError,
        match="rewards that apply to any built-in text task: verifier, "
        "digits, math, countdown, sudoku",
    ):
        load_config(None, G, ["rewards=[{name: geneval}]"])


def test_the_shipped_grpo_config_advertises_only_usable_rewards():
    text = (CONFIGS / "grpo_arithmetic.yaml").read_text()
    rewards_comment = text[text.index("rewards:") : text.index("  - {name:")]
    for name in ("countdown", "sudoku"):
        assert name not in rewards_comment
    for name in TASK_REWARDS["arithmetic"]:
        assert name in rewards_comment
        load_config(CONFIGS / "grpo_arithmetic.yaml", G, [f"rewards=[{{name: {name}}}]"])


# ----------------------------------------------------------------------------- the LR schedule
@pytest.mark.parametrize(("name", "cls"), SHIPPED)
def test_the_schedule_follows_steps_in_every_shipped_config(name, cls):
    config = load_config(CONFIGS / name, cls, ["steps=50"])
    optim = config.optim
    assert optim.warmup_steps <= 5
    if cls in (S, FS):
        assert optim.total_steps == 50
    else:  # constant: total_steps unused, so not pinned (extending a run stays resumable)
        assert (optim.schedule, optim.total_steps) == ("constant", None)
        decaying = load_config(CONFIGS / name, cls, ["steps=50", "optim.schedule=cosine"])
        assert decaying.optim.total_steps == 50
    # warm-up finishes, then the schedule reaches its end exactly at step 50
    w = optim.warmup_steps
    assert [lr_factor(optim, s) for s in range(w)] == [(s + 1) / w for s in range(w)]
    final = optim.min_lr_ratio if optim.schedule != "constant" else 1.0
    assert lr_factor(optim, 50) == pytest.approx(final)
    if optim.schedule == "cosine":
        for step in (w, 20, 37):
            progress = (step - w) / (50 - w)
            shape = 0.5 * (1 + math.cos(math.pi * progress))
            expected = optim.min_lr_ratio + (1 - optim.min_lr_ratio) * shape
            assert lr_factor(optim, step) == pytest.approx(expected)


def test_the_sft_schedule_over_steps():
    config = load_config(CONFIGS / "sft_arithmetic.yaml", SFTRecipeConfig, ["steps=50"])
    assert (config.optim.total_steps, config.optim.warmup_steps) == (50, 5)
    long = load_config(CONFIGS / "sft_arithmetic.yaml", SFTRecipeConfig, ["steps=4000"])
    assert (long.optim.total_steps, long.optim.warmup_steps) == (4000, 100)
    assert lr_factor(long.optim, 3999) > long.optim.min_lr_ratio  # still decaying at the end
    pinned = load_config(None, SFTRecipeConfig, ["steps=50", "optim.total_steps=80"])
    assert (pinned.optim.total_steps, pinned.optim.warmup_steps) == (80, 8)
    distill = load_config(None, DistillRecipeConfig, ["steps=50"])
    assert distill.optim.warmup_steps == 5 and DistillRecipeConfig().optim.warmup_steps == 20


# ----------------------------------------------------------------------------- shipped configs
def commented_keys(text: str) -> set[str]:
    return set(re.findall(r"^\s*# ([a-z_]+):", text, flags=re.MULTILINE))


@pytest.mark.parametrize(("name", "cls"), SHIPPED)
def test_every_shipped_config_is_the_defaults_and_lists_every_key(name, cls):
    path = CONFIGS / name
    assert load_config(path, cls) == cls()
    text = path.read_text()
    listed = yaml.safe_load(text)
    dumped = cls().model_dump()
    assert set(listed) == set(dumped)
    commented = commented_keys(text)
    for section, values in dumped.items():
        if isinstance(values, dict) and isinstance(listed[section], dict):
            missing = set(values) - set(listed[section])
            assert missing <= commented, (section, missing)  # only the documented defaults
            assert not set(listed[section]) - set(values)


# ----------------------------------------------------------------------------- printing
PRINT_CASES = [
    (S, []),
    (S, ["task.num_digits=2", "model.d_model=64", "optim.schedule=linear", "seed=7"]),
    (G, ["task.name=arithmetic", "rewards=[{name: digits, weight: 0.5}, {name: verifier}]"]),
    (G, ["policy.algorithm=dapo", "offload_device=cpu", "optim.schedule=cosine"]),
    (D, ["objective.hard_weight=0.5", "steps=30"]),
    (FS, ["task.kinds=[count]", "model.patch_size=2", "sampler.kernels={}"]),
    (FG, ["sampler.sde_window=[0, 4]", "ema_decay=0.99", "policy.beta=0.0"]),
    (
        FG,
        ["rewards=[{name: geneval, options: {mode: all}}, {name: compressibility, weight: 0.1}]"],
    ),
]


def all_keys(tree, prefix=()):
    keys = set()
    for key, value in tree.items():
        keys.add(prefix + (key,))
        if isinstance(value, dict):
            keys |= all_keys(value, prefix + (key,))
    return keys


@pytest.mark.parametrize(("cls", "sets"), PRINT_CASES)
def test_the_printed_config_reloads_equal(tmp_path, cls, sets):
    config = load_config(None, cls, sets)
    text = config_to_yaml(config)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(path, cls) == config
    # every key, each with a comment (its type and bounds)
    printed = yaml.safe_load(text)
    assert all_keys(printed) == all_keys(config.model_dump(mode="json"))
    for line in text.splitlines():
        if ":" in line and not line.lstrip().startswith(("#", "-")):
            assert "  # " in line, line


def test_printed_comments_give_types_and_bounds():
    text = config_to_yaml(SFTRecipeConfig())
    assert "  lr: 0.002  # float > 0\n" in text
    assert f"\nsteps: 2000  # int > 0, <= {LIMITS['steps']}\n" in text
    assert "  schedule: cosine  # constant | linear | cosine\n" in text
    assert "\nthreads: null  # int > 0, <= 1024 or null\n" in text
    assert "\ndevice: cpu  # cpu | cuda | cuda:N | mps\n" in text
    assert "\noptim:  # AdamW and learning-rate schedule settings\n" in text


def test_build_config_still_validates_python_data():
    with pytest.raises(ConfigError, match="optim.lr: expected a finite number"):
        build_config(SFTRecipeConfig, {"optim": {"lr": float("inf")}})
    with pytest.raises(ConfigError, match="steps: expected an integer"):
        build_config(SFTRecipeConfig, {"steps": True})


def test_an_override_below_a_value_is_refused():
    with pytest.raises(ConfigError) as info:
        parse_overrides(["steps=3", "steps.x=1"])
    assert str(info.value) == "--set 'steps.x=1': 'steps' was set to a value, not a section"
