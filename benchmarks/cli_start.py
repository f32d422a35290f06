"""Start-up cost of the command line, as JSON: CPU seconds of `diffusion-rl --version`,
`--help`, every `COMMAND --help` and the Hub-id refusal (`generate --model org/name`,
`eval --model org/name`), each against `python -c pass` in the same interpreter; and the
cost of refusing hostile configs (`diffusion-rl sft --config FILE` for brackets nested
100 000 deep, a 100 000-digit integer, 200 000 and 3 000 unknown keys, an alias bomb): CPU
seconds and the size of the error (targets: < 2 s, < 2 KB of stderr, exit 2; the memory the
config checks allocate is bounded by tests/test_config.py).

Each case runs as a fresh process (the installed `diffusion-rl` entry point next to this
interpreter, else `python -m diffusion_rl`); its CPU time (user + system) is read with
``resource.getrusage(RUSAGE_CHILDREN)`` around the wait, so it does not depend on the load
of the machine the way wall time does (both are reported; medians of `--reps`). A second,
untimed run of each case inside a wrapper records whether it imported torch.

    python benchmarks/cli_start.py [--reps 5] [--output cli_start.json]

Prints ``{"python_pass": {"cpu_s": ...}, "cases": {"--version": {"cpu_s": ...,
"over_python_cpu_s": ..., "wall_s": ..., "exit": 0, "imports_torch": false}, ...},
"max_cpu_s": ..., "target_cpu_s": 0.5, "target_met": true, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_CPU_S = 0.5
_WRAPPER = """
import contextlib, io, json, sys
from diffusion_rl.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exit_:
        code = exit_.code
print(json.dumps({"exit": code, "imports_torch": "torch" in sys.modules}))
"""


def _command() -> list[str]:
    """How a user starts the command line here."""
    exe = shutil.which("diffusion-rl", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "diffusion_rl"]


def _cases() -> dict[str, list[str]]:
    """Every case, by its name (the arguments as typed)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from diffusion_rl.cli import build_parser

    parser = build_parser()
    commands = next(
        list(action.choices)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    cases = {"--version": ["--version"], "--help": ["--help"]}
    cases.update({f"{name} --help": [name, "--help"] for name in commands})
    cases["generate --model org/name"] = ["generate", "--model", "org/name", "--prompt", "1+2="]
    cases["eval --model org/name"] = ["eval", "--model", "org/name"]
    return cases


CONFIG_TARGET_CPU_S = 2.0
CONFIG_TARGET_STDERR = 2048


def _config_bombs(directory: str) -> dict[str, list[str]]:
    """Hostile config files written into ``directory``, as ``sft --config FILE`` cases."""
    texts = {
        "nested 100000 deep": "steps: " + "[" * 100_000 + "]" * 100_000,
        "integer of 100000 digits": "steps: " + "9" * 100_000,
        "200000 unknown keys": "\n".join(f"key{i}: 1" for i in range(200_000)),
        "3000 unknown keys": "\n".join(f"key{i}: 1" for i in range(3_000)),
        "alias bomb": "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [{', '.join('*' + p for _ in range(9))}]\n"
            for p, c in zip("abcdefgh", "bcdefghi")
        ),
    }
    cases = {}
    for name, text in texts.items():
        path = Path(directory) / (name.replace(" ", "_") + ".yaml")
        path.write_text(text + "\n")
        cases[f"sft --config <{name}>"] = ["sft", "--config", str(path)]
    return cases


def _timed(argv: list[str], cwd: str) -> tuple[float, float, int, bytes]:
    """(CPU seconds, wall seconds, exit status, stderr) of one process running ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall, done.returncode, done.stderr


def _median(runs: list[tuple[float, float, int]]) -> dict:
    return {
        "cpu_s": round(statistics.median(r[0] for r in runs), 4),
        "wall_s": round(statistics.median(r[1] for r in runs), 4),
        "cpu_s_runs": [round(r[0], 4) for r in runs],
        "exit": runs[-1][2],
        "stderr_bytes": len(runs[-1][3]),
        "stderr_lines": len(runs[-1][3].splitlines()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed runs of each case (median)")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    cases = _cases()
    command = _command()
    env_cwd = tempfile.mkdtemp(prefix="cli-start-")  # no org/name directory here
    try:
        baseline = _median(
            [_timed([sys.executable, "-c", "pass"], env_cwd) for _ in range(args.reps)]
        )
        results = {}
        for name, case in cases.items():
            print(f"{name} ...", file=sys.stderr)
            _timed([*command, *case], env_cwd)  # warm the file cache
            result = _median([_timed([*command, *case], env_cwd) for _ in range(args.reps)])
            result["over_python_cpu_s"] = round(result["cpu_s"] - baseline["cpu_s"], 4)
            probe = subprocess.run(
                [sys.executable, "-c", _WRAPPER, *case],
                cwd=env_cwd,
                capture_output=True,
                text=True,
                check=False,
            )
            lines = probe.stdout.strip().splitlines()
            result["imports_torch"] = json.loads(lines[-1])["imports_torch"] if lines else None
            results[name] = result
        bombs = {}
        for name, case in _config_bombs(env_cwd).items():
            print(f"{name} ...", file=sys.stderr)
            bombs[name] = _median([_timed([*command, *case], env_cwd) for _ in range(args.reps)])
    finally:
        shutil.rmtree(env_cwd, ignore_errors=True)
    worst = max(r["cpu_s"] for r in results.values())
    report = {
        "command": command,
        "python_pass": baseline,
        "cases": results,
        "max_cpu_s": worst,
        "max_over_python_cpu_s": round(max(r["over_python_cpu_s"] for r in results.values()), 4),
        "target_cpu_s": TARGET_CPU_S,
        "target_met": worst < TARGET_CPU_S,
        "any_imports_torch": any(r["imports_torch"] for r in results.values()),
        "config_bombs": bombs,
        "config_target_met": all(
            b["cpu_s"] < CONFIG_TARGET_CPU_S
            and b["stderr_bytes"] < CONFIG_TARGET_STDERR
            and b["exit"] == 2
            for b in bombs.values()
        ),
        "reps": args.reps,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    text = json.dumps(report)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    return 0 if report["target_met"] and report["config_target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
