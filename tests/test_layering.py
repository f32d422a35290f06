"""The package's layers point down only, and its import graph has no cycle.

Read from the source with ``ast`` (every import statement, top level or inside a function;
imports under ``if TYPE_CHECKING:`` are annotations only and are skipped). The layers are
those of docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "src" / "diffusion_rl"

# rank of each top-level module or package (lower = nearer the ground)
LAYERS = {
    "contracts": 0,
    "kernels": 0,
    "seeding": 0,
    "guidance": 0,
    "advantages": 0,
    "checksums": 0,
    "_lazy": 0,
    "models": 1,
    "distributed": 0,
    "trace": 2,
    "trace_io": 2,
    "sampling": 2,
    "scoring": 2,
    "objectives": 2,
    "tasks": 3,
    "rewards": 3,
    "reward_models": 3,
    "evaluation": 3,
    "plots": 3,
    "workflows": 3,
    "rollout": 4,
    "rollout_remote": 4,
    "train": 5,
    "config": 6,
    "recipes": 6,
    "quickstart": 7,
    "cli": 7,
    "serving": 7,
    "__init__": 7,
    "__main__": 7,
}
# imports that would not break the ranks but that the design forbids
FORBIDDEN = {("scoring", "sampling"): "replay must not import the sampler"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for child in ast.walk(node))
    return skipped


def imports_of(path: Path) -> set[str]:
    """The ``diffusion_rl`` modules ``path`` imports (absolute names)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("diffusion_rl"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("diffusion_rl"):
                continue
            for alias in node.names:  # `from .pkg import module` imports the module
                candidate = f"{target}.{alias.name}"
                if (ROOT.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or (
                    ROOT.parent / candidate.replace(".", "/") / "__init__.py"
                ).exists():
                    found.add(candidate)
                else:
                    found.add(target)
    return found


def top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


GRAPH = {module_name(p): imports_of(p) for p in ROOT.rglob("*.py")}


def test_every_module_has_a_layer():
    assert {top(m) for m in GRAPH} <= set(LAYERS), sorted({top(m) for m in GRAPH} - set(LAYERS))


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    for target in sorted(GRAPH[module]):
        here, there = top(module), top(target)
        assert LAYERS[there] <= LAYERS[here], f"{module} imports {target}: an upward import"
        assert (here, there) not in FORBIDDEN, (
            f"{module} imports {target}: {FORBIDDEN[(here, there)]}"
        )


def test_no_recipe_imports_another_recipe():
    shared = {"diffusion_rl.recipes", "diffusion_rl.recipes.run", "diffusion_rl.recipes.common"}
    for module, targets in GRAPH.items():
        if module.startswith("diffusion_rl.recipes.") and module not in shared:
            others = {t for t in targets if t.startswith("diffusion_rl.recipes.")} - shared
            assert not others, f"{module} imports the recipes {sorted(others)}"


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(GRAPH.get(node, ())):
            if target not in GRAPH or target == node:
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target) :] + [target] if target in stack else [target]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if state.get(target) is None:
                visit(target, [*stack, target])
        state[node] = 2

    for module in sorted(GRAPH):
        if state.get(module) is None:
            visit(module, [module])


def test_the_checker_sees_relative_imports():
    """A self-check, so the tests above cannot pass by finding nothing."""
    assert "diffusion_rl.contracts" in GRAPH["diffusion_rl.trace"]
    assert "diffusion_rl.train.learner" in GRAPH["diffusion_rl.recipes.grpo"]
    assert "diffusion_rl.models.io" in GRAPH["diffusion_rl.recipes.common"]
