"""Names of a package that are imported on first use (:pep:`562`): the package faces
(``diffusion_rl``, ``diffusion_rl.models``, ``diffusion_rl.config``) re-export their parts this
way, so importing one of their light submodules (the command line, ``models.loading``,
``config.loading``) does not import torch and the rest of the package."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps each name to
    the module (relative to ``package``) that defines it; any other name that is a submodule
    of the package is imported as one. A value is cached in ``namespace`` (the package's
    globals) once looked up, so a name is imported once and ``monkeypatch.setattr`` on the
    package works as on any module."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
        elif not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}"):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
