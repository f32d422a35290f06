"""What every Hugging Face token-denoiser adapter shares (LLaDA, Dream, SDAR).

An adapter wraps one of transformers' *stock* decoder classes (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``) as :class:`HFTokenDenoiser`: it maps the family's
``config.json`` to the stock config, renames the family's state-dict keys with a
:class:`KeyMap`, and calls the network with an explicit 4-D bool attention mask (SDPA) and
explicit position ids. No code from a checkpoint directory is ever run.

The pieces, each usable alone (helper functions for adapters that need their own forward):

* config checks: :func:`read_json_object`, :func:`config_int`, :func:`config_float`,
  :func:`config_bool`, :func:`config_value`, :func:`resolve_dtype`;
* weights: :func:`find_checkpoint` (safetensors only, single file or sharded
  ``model.safetensors.index.json``; a pickle-only directory is refused), :func:`read_weights`,
  :func:`write_weights`;
* the network: :func:`build_empty` (on the meta device: nothing allocated, nothing randomly
  initialised), :func:`load_network` (strict key check naming missing / unexpected keys, then
  the real tensors are assigned and the non-persistent RoPE buffers rebuilt),
  :func:`network_state` (what is saved: tied aliases dropped);
* the canvas: :func:`bidirectional_mask` and :func:`protocol_positions`;
* :class:`FamilyConfig` (``model.config``: the family's own ``config.json`` values).

Invariants: loading never executes remote code and reads nothing but JSON and safetensors;
every refusal is a ``ValueError`` subclass (or ``FileNotFoundError``) naming the file and the
key; the parameter count of a config is computed without allocating anything.
"""

from __future__ import annotations

import copy
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..loading import MAX_JSON_BYTES, ModelConfigError, check_local_directory

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files that are pickles (loading one can run arbitrary code): always refused."""
DEFAULT_MAX_SHARD_BYTES = 5 << 30
""":func:`write_weights` starts a new shard past this size (5 GiB, as transformers does)."""
LLAMA_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Module-name suffixes of every linear layer of a Llama / Qwen decoder block (LoRA targets)."""

SIZE_LIMIT = 1 << 20
"""The largest width, vocabulary or MLP size a family config may ask for (1 Mi)."""
LAYER_LIMIT = 1024
"""The largest number of layers or heads a family config may ask for."""
POSITION_LIMIT = 1 << 24
"""The largest ``max_position_embeddings`` / ``max_sequence_length`` accepted."""

_SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class CheckpointKeyError(ValueError):
    """The weights do not match the architecture ``config.json`` describes: ``missing`` keys
    the network needs and the file lacks, ``unexpected`` keys the file has and the network does
    not (both in the family's own key names)."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected


class CheckpointFormatError(ValueError):
    """A checkpoint directory whose weights are not (only) safetensors, or whose shard index is
    malformed; the message names the file and how to fix it."""


# ----------------------------------------------------------------------------- config checks
def read_json_object(path: Path, what: str = "model config") -> dict[str, Any]:
    """The JSON object in ``path``, refused (:class:`ModelConfigError`) when larger than
    :data:`~diffusion_rl.models.io.MAX_JSON_BYTES`, not JSON, or not an object."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ModelConfigError(
            f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a {what} may have"
        )
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


_MISSING = object()


def config_value(config: Mapping[str, Any], key: str, default: Any = _MISSING, *, where: str):
    """``config[key]`` (``default`` when absent or null); a missing key without a default is a
    :class:`ModelConfigError` ``"{where}: missing key {key}"``."""
    value = config.get(key)
    if value is None:
        if default is _MISSING:
            raise ModelConfigError(f"{where}: missing key {key}")
        return default
    return value


def config_int(
    config: Mapping[str, Any],
    key: str,
    default: Any = _MISSING,
    *,
    where: str,
    low: int = 1,
    high: int = SIZE_LIMIT,
) -> int:
    """``config[key]`` as an integer in ``[low, high]`` (a bool, float or string is refused, not
    coerced); errors name ``where`` and ``key``."""
    value = config_value(config, key, default, where=where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(
            f"{where}: {key}: expected an integer, got {type(value).__name__} {value!r}"
        )
    if value > high:
        raise ModelConfigError(f"{where}: {key}={value} exceeds the limit {high}")
    if value < low:
        raise ModelConfigError(f"{where}: {key}: must be >= {low} (got {value})")
    return value


def config_float(
    config: Mapping[str, Any], key: str, default: Any = _MISSING, *, where: str, positive=True
) -> float:
    """``config[key]`` as a finite float (``> 0`` when ``positive``, else ``>= 0``)."""
    value = config_value(config, key, default, where=where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelConfigError(f"{where}: {key}: expected a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ModelConfigError(
            f"{where}: {key}: must be {'>' if positive else '>='} 0, got {value}"
        )
    return float(value)


def config_bool(config: Mapping[str, Any], key: str, default: Any = _MISSING, *, where: str):
    """``config[key]`` as a bool (JSON ``true`` / ``false`` only)."""
    value = config_value(config, key, default, where=where)
    if not isinstance(value, bool):
        raise ModelConfigError(f"{where}: {key}: expected true or false, got {value!r}")
    return value


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.bfloat16`` for ``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` (likewise
    float32 and float16); ``None`` stays ``None`` (keep the stored dtype)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype: expected a floating dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or a torch dtype, got {dtype!r}")


# ----------------------------------------------------------------------------- weights files
@dataclass(frozen=True)
class Checkpoint:
    """The safetensors weights of a directory: ``files`` (one, or the shards an index names),
    ``stored_itemsize`` (bytes per element of its widest floating tensor) and
    ``largest_file_bytes`` (what reading one file may hold in memory at once)."""

    files: tuple[Path, ...]
    stored_itemsize: int
    largest_file_bytes: int


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON), read
    without touching the tensors; bounded by ``MAX_JSON_BYTES``."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise CheckpointFormatError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_JSON_BYTES or length > path.stat().st_size - 8:
            raise CheckpointFormatError(
                f"{path}: not a safetensors file (header length {length} is out of bounds)"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointFormatError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: not a safetensors file (bad header)")
    return header


def _pickle_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)


def find_checkpoint(directory: str | Path) -> Checkpoint:
    """The safetensors weights of ``directory``: ``model.safetensors``, or the shards named by
    ``model.safetensors.index.json`` (each a plain file name inside ``directory``).

    Raises:
        CheckpointFormatError: only pickle weights (``*.bin``, ``*.pt``, ...) are present (the
            message says to convert them), the index is malformed or names a path outside
            ``directory``, or a file is not safetensors.
        FileNotFoundError: no weights at all, or a shard the index names is missing.
    """
    directory = Path(directory)
    single, index = directory / WEIGHTS_FILE, directory / WEIGHTS_INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json_object(index, "weights index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFormatError(f"{index}: expected a non-empty object weight_map")
        names = sorted({str(name) for name in weight_map.values()})
        for name in names:
            if (
                Path(name).name != name
                or name in ("", ".", "..")
                or not name.endswith(".safetensors")
            ):
                raise CheckpointFormatError(
                    f"{index}: weight_map names {name!r}; expected the file name of a "
                    ".safetensors shard in the same directory"
                )
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{index}: names the shard {name}, which is missing")
        files = [directory / name for name in names]
    else:
        pickles = _pickle_files(directory)
        if pickles:
            raise CheckpointFormatError(
                f"{directory}: weights {pickles} are pickle files, which diffusion_rl never "
                f"loads (unpickling can run arbitrary code); convert them to safetensors "
                f"({WEIGHTS_FILE}), e.g. load them once in a trusted environment and call "
                "save_pretrained(dir, safe_serialization=True)"
            )
        raise FileNotFoundError(
            f"{directory}: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} (safetensors weights)"
        )
    itemsize = 0
    for path in files:
        for name, entry in _safetensors_header(path).items():
            if name != "__metadata__" and isinstance(entry, dict):
                itemsize = max(itemsize, _SAFETENSORS_ITEMSIZE.get(str(entry.get("dtype")), 0))
    largest = max(path.stat().st_size for path in files)
    return Checkpoint(tuple(files), itemsize or 4, largest)


def read_weights(
    checkpoint: Checkpoint,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint`` (floating ones cast to ``dtype`` when given, all moved to
    ``device``), read one tensor at a time so a cast holds at most one extra tensor.

    Raises:
        CheckpointFormatError: a key appears in two shards.
    """
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for path in checkpoint.files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if key in state:
                    raise CheckpointFormatError(f"{path}: key {key} is also in another shard")
                tensor = handle.get_tensor(key)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                state[key] = tensor if device is None else tensor.to(device)
    return state


def write_weights(
    state: Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write ``state`` as ``model.safetensors`` (metadata ``format: pt``, as transformers
    writes), or, past ``max_shard_bytes``, as ``model-0000k-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json``. Returns the files written."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(state):
        tensor = state[key].detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(directory / WEIGHTS_FILE), metadata=metadata)
        return [directory / WEIGHTS_FILE]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(directory / name), metadata=metadata)
    total = sum(t.numel() * t.element_size() for t in state.values())
    weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [directory / name for name in names] + [directory / WEIGHTS_INDEX_FILE]


# ----------------------------------------------------------------------------- key maps
class KeyMap:
    """A bijection between a family's state-dict keys and the stock class's.

    Built from ``(family_template, stock_template)`` pairs; ``{i}`` in a template stands for a
    layer index. A key that no pair matches has no image (:meth:`to_stock` /
    :meth:`to_family` return ``None``), which the strict key check reports as unexpected.
    """

    def __init__(self, pairs: Iterable[tuple[str, str]] = ()) -> None:
        self.pairs = tuple(pairs)
        self._forward = [(self._compile(f), s) for f, s in self.pairs]
        self._backward = [(self._compile(s), f) for f, s in self.pairs]

    @staticmethod
    def _compile(template: str) -> re.Pattern[str]:
        return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")

    @staticmethod
    def _apply(rules, key: str) -> str | None:
        for pattern, target in rules:
            match = pattern.match(key)
            if match:
                return target.replace("{i}", match.groupdict().get("i") or "")
        return None

    @property
    def identity(self) -> bool:
        return not self.pairs

    def to_stock(self, key: str) -> str | None:
        return key if self.identity else self._apply(self._forward, key)

    def to_family(self, key: str) -> str | None:
        return key if self.identity else self._apply(self._backward, key)


# ----------------------------------------------------------------------------- the network
def require_transformers():
    """``transformers``, refused with an install hint if missing or older than 5.0 (the
    adapters rely on its ``rope_parameters`` configs and 4-D mask pass-through)."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "the Hugging Face token adapters need transformers>=5: pip install -e '.[hf]'"
        ) from None
    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise ImportError(
            f"the Hugging Face token adapters need transformers>=5, found "
            f"{transformers.__version__}: pip install -U 'transformers>=5'"
        )
    return transformers


def build_empty(network_class: type, stock_config) -> nn.Module:
    """``network_class(stock_config)`` on the meta device with SDPA attention: no memory and no
    random initialisation; :func:`load_network` then assigns the real tensors."""
    stock_config._attn_implementation = "sdpa"
    with torch.device("meta"):
        network = network_class(stock_config)
    return network


def _aliases(network: nn.Module) -> dict[str, str]:
    """Tied parameters: ``alias name → canonical name`` (the first name of a shared tensor)."""
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in network.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(parameter), name)
        if first != name:
            aliases[name] = first
    return aliases


def _rebuild_rotary(network: nn.Module, device) -> None:
    """Replace every RoPE module whose (non-persistent) buffers are still on the meta device by
    a fresh one built from its config, on ``device``."""
    for name, module in list(network.named_modules()):
        if hasattr(module, "original_inv_freq") and module.inv_freq.is_meta:
            fresh = type(module)(module.config).to(device)
            parent_name, _, attribute = name.rpartition(".")
            setattr(network.get_submodule(parent_name), attribute, fresh)


def _sample(keys: Iterable[str], count: int = 12) -> str:
    keys = sorted(keys)
    more = f" (and {len(keys) - count} more)" if len(keys) > count else ""
    return f"{keys[:count]}{more}"


def load_network(
    network: nn.Module,
    family_state: Mapping[str, torch.Tensor],
    key_map: KeyMap,
    *,
    where: str,
    family: str,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Assign ``family_state`` (the checkpoint, in the family's key names) to the meta-device
    ``network``, strictly: every parameter and persistent buffer must come from the file, and
    every key of the file must map to one. Tied parameters (e.g. ``lm_head`` = embeddings) may
    be stored under either name. RoPE buffers are rebuilt on ``device``.

    Raises:
        CheckpointKeyError: missing or unexpected keys (named, in the family's names), or a
            tensor whose shape differs from the architecture's.
    """
    aliases = _aliases(network)
    expected = {k for k in network.state_dict() if k not in aliases}
    stock: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}  # stock key -> the file's key it came from
    unexpected: list[str] = []
    for key, tensor in family_state.items():
        target = key_map.to_stock(key)
        target = aliases.get(target, target)
        if target is None or target not in expected:
            unexpected.append(key)
        elif target not in stock:
            stock[target], source[target] = tensor, key
        elif not torch.equal(stock[target], tensor):  # a tied tensor stored twice, differently
            pair = sorted([source[target], key])
            raise CheckpointKeyError(
                f"{where}: config.json ties {pair[0]} and {pair[1]}, but the file stores two "
                "different tensors for them",
                [],
                [key],
            )
    missing = sorted(key_map.to_family(k) or k for k in expected - set(stock))
    if missing or unexpected:
        parts = [f"missing keys {_sample(missing)}"] if missing else []
        parts += [f"unexpected keys {_sample(unexpected)}"] if unexpected else []
        raise CheckpointKeyError(
            f"{where}: the weights do not match the {family} architecture config.json "
            f"describes: {'; '.join(parts)}",
            missing,
            sorted(unexpected),
        )
    shapes = dict(network.state_dict())
    wrong = [
        f"{key_map.to_family(k)} {tuple(t.shape)} (expected {tuple(shapes[k].shape)})"
        for k, t in stock.items()
        if tuple(t.shape) != tuple(shapes[k].shape)
    ]
    if wrong:
        raise CheckpointKeyError(
            f"{where}: tensors whose shape differs from the {family} architecture config.json "
            f"describes: {_sample(wrong, 6)}",
            [],
            [],
        )
    network.load_state_dict(stock, strict=False, assign=True)
    for alias, canonical in aliases.items():
        parent_name, _, attribute = alias.rpartition(".")
        setattr(network.get_submodule(parent_name), attribute, network.get_parameter(canonical))
    first = next(iter(stock.values()))
    _rebuild_rotary(network, first.device if device is None else device)
    left = [n for n, t in [*network.named_parameters(), *network.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{where}: tensors left unloaded on the meta device: {left}")
    return network


def network_state(network: nn.Module) -> dict[str, torch.Tensor]:
    """The network's state dict in stock key names, tied aliases left out (what a checkpoint
    of a tied model stores)."""
    aliases = _aliases(network)
    return {k: v for k, v in network.state_dict().items() if k not in aliases}


# ----------------------------------------------------------------------------- the canvas
def bidirectional_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, 1, T, T]`` (True = may attend): every query sees every non-padding key.

    A padding *query* also sees itself, so no row is fully masked (a fully masked SDPA row is
    NaN or 0 depending on the kernel); this changes nothing for real queries, whose logits are
    the only ones defined (padding keys stay masked for them).
    """
    t = key_mask.shape[1]
    eye = torch.eye(t, dtype=torch.bool, device=key_mask.device)
    return key_mask.bool()[:, None, None, :] | eye[None, None]


def protocol_positions(key_mask: torch.Tensor) -> torch.Tensor:
    """``cumsum(key_mask) - 1`` (0 on left padding): a real token's position does not depend on
    how much its row is padded (models/protocol.py)."""
    return (key_mask.long().cumsum(1) - 1).clamp_min(0)


# ----------------------------------------------------------------------------- the adapter
class FamilyConfig(Mapping):
    """``model.config`` of an adapter: the family's own ``config.json`` values (read-only
    mapping), plus ``max_seq_len`` and ``model_dump()`` (a deep copy of the values, JSON-ready)
    so code written for the built-in configs keeps working."""

    def __init__(self, values: Mapping[str, Any], *, max_seq_len: int) -> None:
        self._values = copy.deepcopy(dict(values))
        self.max_seq_len = max_seq_len

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def model_dump(self, mode: str | None = None) -> dict[str, Any]:
        return copy.deepcopy(self._values)

    def __repr__(self) -> str:
        return f"FamilyConfig(model_type={self._values.get('model_type')!r})"


EXTRA_FILES = ("generation_config.json",)
"""Small JSON files of a checkpoint directory kept and written back by ``save_pretrained``
(Dream's own loader reads ``generation_config.json`` unconditionally)."""


def decoder_keywords(
    sizes: Mapping[str, int], max_positions: int, config: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """The keywords every stock decoder config (``LlamaConfig``, ``Qwen2Config``) takes from a
    family's checked sizes (``vocab``, ``d``, ``mlp``, ``layers``, ``heads``, ``kv``): the
    widths, a SiLU MLP, ``max_positions`` and the config's ``attention_dropout``."""
    return {
        "vocab_size": sizes["vocab"],
        "hidden_size": sizes["d"],
        "intermediate_size": sizes["mlp"],
        "num_hidden_layers": sizes["layers"],
        "num_attention_heads": sizes["heads"],
        "num_key_value_heads": sizes["kv"],
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "attention_dropout": config_float(
            config, "attention_dropout", 0.0, where=where, positive=False
        ),
    }


class HFTokenDenoiser(nn.Module):
    """A stock transformers decoder behind the :class:`~diffusion_rl.models.TokenDenoiser`
    protocol. Subclasses set ``family``, ``key_map``, ``network_class_name`` and implement
    :meth:`stock_config`, :meth:`parameter_count`, :meth:`vocab_size_of`,
    :meth:`max_seq_len_of`; the base class does loading, saving, the forward (bidirectional
    unless :meth:`canvas_mask` is overridden, as SDAR's block-causal mask does), activation
    checkpointing and the parameter count. :meth:`saved_config` is what
    :meth:`save_pretrained` writes as ``config.json``.

    ``self.network`` is the stock model (``self.network.config`` its transformers config);
    ``self.config`` the family's own config (:class:`FamilyConfig`). ``alignment`` is the
    alignment of the logits :meth:`forward` returns (always target-aligned);
    ``native_alignment`` that of the family's raw network.
    """

    family: ClassVar[str] = ""
    key_map: ClassVar[KeyMap] = KeyMap()
    network_class_name: ClassVar[str] = ""
    alignment: ClassVar[str] = "same_position"
    native_alignment: ClassVar[str] = "same_position"
    attention: ClassVar[str] = "bidirectional"
    block_size: int | None = None
    lora_targets: ClassVar[tuple[str, ...]] = LLAMA_LINEAR_NAMES

    def __init__(
        self,
        network: nn.Module,
        family_config: Mapping[str, Any],
        extra_files: Mapping[str, dict] | None = None,
    ) -> None:
        super().__init__()
        for module in network.modules():  # masks are always explicit (causal masking off)
            if hasattr(module, "is_causal"):
                module.is_causal = False
        self.network = network
        where = f"{self.family} config"
        self.config = FamilyConfig(family_config, max_seq_len=self.max_seq_len_of(family_config))
        self._vocab_size = self.vocab_size_of(family_config)
        self._mask_token_id = config_int(
            family_config, "mask_token_id", where=where, low=0, high=self._vocab_size - 1
        )
        self.extra_files = copy.deepcopy(dict(extra_files or {}))

    # ------------------------------------------------------------------ subclass hooks
    @classmethod
    def stock_config(cls, config: Mapping[str, Any], where: str = CONFIG_FILE):
        """The transformers config of the stock class for the family ``config`` (validated:
        a feature the stock class cannot express is a :class:`ModelConfigError`)."""
        raise NotImplementedError

    @classmethod
    def parameter_count(cls, config: Mapping[str, Any]) -> int:
        """The parameter count of the model ``config`` describes, from its sizes alone."""
        raise NotImplementedError

    @classmethod
    def vocab_size_of(cls, config: Mapping[str, Any]) -> int:
        """Rows of the embedding / logits (may exceed the tokenizer's length)."""
        raise NotImplementedError

    @classmethod
    def max_seq_len_of(cls, config: Mapping[str, Any]) -> int:
        raise NotImplementedError

    @classmethod
    def network_class(cls) -> type:
        return getattr(require_transformers(), cls.network_class_name)

    # ------------------------------------------------------------------ protocol fields
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def mask_token_id(self) -> int:
        return self._mask_token_id

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each decoder layer in backward through the network's own activation
        (gradient) checkpointing; only in training mode, as transformers does."""
        net = self.network
        if enabled:
            enable = getattr(net, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                net.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        else:
            disable = getattr(net, "activation_checkpointing_disable", None)
            (disable or net.gradient_checkpointing_disable)()

    @property
    def activation_checkpointing(self) -> bool:
        """Whether the network recomputes its layers in backward (in training mode)."""
        net = self.network
        flag = getattr(net, "is_activation_checkpointing", None)
        return bool(net.is_gradient_checkpointing if flag is None else flag)

    # ------------------------------------------------------------------ forward
    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(
                f"input_ids: expected integer ids [B, T], got {input_ids.dtype} "
                f"{tuple(input_ids.shape)}"
            )
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= self._vocab_size:
            raise ValueError(
                f"input_ids: ids must be in [0, vocab_size={self._vocab_size}), got "
                f"[{low}, {high}]; is the tokenizer the model's?"
            )

    def run_network(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        **network_options: Any,
    ) -> torch.Tensor:
        """The stock network's raw logits ``[B, T, V]`` (native alignment) for an explicit
        bool ``attention_mask [B, 1, T, K]`` (True = may attend) and ``position_ids [B, T]``;
        ``network_options`` go to the network's forward as they are (e.g. a KV cache view)."""
        out = self.network(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **network_options,
        )
        return out.logits

    def canvas_mask(self, key_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The bool attention mask ``[B, 1, T, T]`` of a canvas with ``key_mask [B, T]`` and
        ``position_ids [B, T]``: :func:`bidirectional_mask` (positions unused). A block-causal
        family overrides it; every real query must see at least one key."""
        return bidirectional_mask(key_mask)

    def raw_logits(
        self,
        input_ids: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The network's logits in its native alignment, with the attention of
        :meth:`canvas_mask` (by default full bidirectional attention with key padding) and
        ``position_ids`` (default: :func:`protocol_positions`)."""
        self.check_input_ids(input_ids)
        if key_mask is None:
            key_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if key_mask.shape != input_ids.shape:
            raise ValueError(
                f"key_mask: expected shape {tuple(input_ids.shape)}, got {tuple(key_mask.shape)}"
            )
        if position_ids is None:
            position_ids = protocol_positions(key_mask)
        return self.run_network(input_ids, self.canvas_mask(key_mask, position_ids), position_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        prompt_length: int = 0,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Target-aligned logits ``[B, T, V]`` (``logits[:, i]`` predicts token ``i``)."""
        return self.raw_logits(input_ids, key_mask, position_ids=position_ids)

    # ------------------------------------------------------------------ load / save
    @classmethod
    def read_config(cls, directory: Path) -> dict[str, Any]:
        path = directory / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{directory}: no {CONFIG_FILE}")
        return read_json_object(path)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
    ) -> HFTokenDenoiser:
        """The checkpoint in the local ``directory`` (the family's own ``config.json`` and
        safetensors weights, key names and all), on ``device`` (default CPU) in ``dtype``
        (default: the dtype the weights are stored in).

        ``trust_remote_code`` is accepted for symmetry with the loaders: the network is always
        transformers' stock class and no code from ``directory`` is run.
        """
        if not isinstance(trust_remote_code, bool):
            raise TypeError(f"trust_remote_code: expected a bool, got {trust_remote_code!r}")
        directory = check_local_directory(directory, f"{cls.__name__}.from_pretrained")
        config = cls.read_config(directory)
        where = str(directory / CONFIG_FILE)
        stock = cls.stock_config(config, where)
        checkpoint = find_checkpoint(directory)
        state = read_weights(checkpoint, dtype=resolve_dtype(dtype), device=device)
        network = build_empty(cls.network_class(), stock)
        load_network(
            network, state, cls.key_map, where=str(directory), family=cls.family, device=device
        )
        extra = {
            name: read_json_object(directory / name, name)
            for name in EXTRA_FILES
            if (directory / name).is_file()
        }
        return cls(network.eval(), config, extra)

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        *,
        seed: int = 0,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
    ) -> HFTokenDenoiser:
        """A randomly initialised model (the stock class's own init, seeded) of the family
        ``config`` (a ``config.json`` object): for tests and tiny local checkpoints."""
        stock = cls.stock_config(config, f"{cls.family} config")
        stock._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        network = cls.network_class()(stock)
        dtype = resolve_dtype(dtype)
        if device is not None:
            network = network.to(device)
        if dtype is not None:  # parameters only: the RoPE buffers stay float32
            for parameter in network.parameters():
                parameter.data = parameter.data.to(dtype)
        return cls(network.eval(), config)

    def family_state(self) -> dict[str, torch.Tensor]:
        """The weights in the family's own key names (what :meth:`save_pretrained` writes).

        Raises:
            CheckpointKeyError: a parameter with no family name (e.g. an unmerged LoRA
                adapter: merge it first).
        """
        state, unnamed = {}, []
        for key, tensor in network_state(self.network).items():
            name = self.key_map.to_family(key)
            if name is None:
                unnamed.append(key)
            else:
                state[name] = tensor
        if unnamed:
            raise CheckpointKeyError(
                f"save_pretrained: parameters with no {self.family} checkpoint name "
                f"{_sample(unnamed)} (an unmerged LoRA adapter? merge it first)",
                [],
                sorted(unnamed),
            )
        return state

    def saved_config(self) -> dict[str, Any]:
        """The ``config.json`` object :meth:`save_pretrained` writes: the values the model was
        loaded with (a deep copy)."""
        return self.config.model_dump()

    def save_pretrained(
        self, directory: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    ) -> None:
        """Write the family's own checkpoint into ``directory``: its ``config.json``
        (:meth:`saved_config`), the weights under its own key names (safetensors, sharded
        past ``max_shard_bytes``) and the extra JSON files it came with, so the family's own
        loader reads the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        write_weights(self.family_state(), directory, max_shard_bytes=max_shard_bytes)
        (directory / CONFIG_FILE).write_text(json.dumps(self.saved_config(), indent=2) + "\n")
        for name, value in self.extra_files.items():
            (directory / name).write_text(json.dumps(value, indent=2) + "\n")


def rope_parameters(config: Mapping[str, Any], where: str, key: str = "rope_theta") -> dict:
    """``{"rope_type": "default", "rope_theta": ...}`` for a family config without RoPE
    scaling (``rope_scaling`` null); any scaling is refused (not mapped)."""
    scaling = config.get("rope_scaling")
    if scaling is not None:
        raise ModelConfigError(
            f"{where}: rope_scaling={scaling!r} is not supported by the stock mapping "
            "(only plain RoPE); remove it or use the family's own code"
        )
    return {"rope_type": "default", "rope_theta": config_float(config, key, where=where)}


def linear_params(inputs: int, outputs: int, bias: bool = False) -> int:
    """Parameters of ``nn.Linear(inputs, outputs, bias)``."""
    return inputs * outputs + (outputs if bias else 0)
