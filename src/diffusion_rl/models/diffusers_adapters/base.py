"""What the SD3, FLUX and Wan adapters share: one diffusers pipeline seen as a VelocityModel.

An adapter holds the pipeline's transformer (trained) and its VAE, text encoders and
tokenizers (frozen), and speaks the :class:`~diffusion_rl.models.protocol.VelocityModel`
protocol (docs/math.md §5):

* ``latents [B, *latent_shape]`` are *unpacked*: ``(C, H, W)`` for images, ``(C, F, H, W)``
  for video, already scaled the way the transformer sees them. Any packing (FLUX's 2×2
  patches), position ids, pooled projections and guidance embeddings stay inside the adapter.
* ``sigma`` is float ``[B]`` in ``[0, 1]``, 1 = pure noise. diffusers transformers take
  ``t = 1000 σ`` (FLUX takes σ and multiplies by 1000 itself); each family converts in
  ``_velocity``.
* The output is the velocity ``v = ε - x0``: this is what diffusers' flow-matching
  transformers predict, since ``FlowMatchEulerDiscreteScheduler.step`` returns
  ``x + (σ_next - σ) · model_output``, the Euler step of ``dx/dσ = ε - x0``.
* ``encode_prompts`` runs the pipeline's own ``encode_prompt`` (padding, CLIP penultimate
  states, zero-padded T5 states exactly as diffusers does it) under ``no_grad``.
* ``decode`` undoes the VAE latent scaling and returns pixels in ``[0, 1]``, float32.

Trainability and checkpoints:

* The VAE and text encoders have ``requires_grad = False`` and stay in eval mode under
  ``.train()``. The transformer is trained in full, or, with ``lora=LoraSettings(...)``, only
  its LoRA weights (peft); :meth:`FlowPipelineAdapter.lora_disabled` gives the reference
  policy of a LoRA run, the actor with its LoRA switched off.
* ``state_dict()`` holds exactly the weights training can change: the transformer's, or only
  its LoRA weights. The frozen parts come from the pipeline directory, so training
  checkpoints and in-memory weight syncs stay small; ``save_frozen=True`` keeps everything.
* :meth:`FlowPipelineAdapter.merge_lora` folds the LoRA into the transformer's weights (peft's
  merge) and :meth:`FlowPipelineAdapter.save_merged` writes the result as a plain diffusers
  pipeline directory (no LoRA, no peft needed to load it).
* :meth:`FlowPipelineAdapter.enable_activation_checkpointing` turns on the transformer's own
  (diffusers') gradient checkpointing; ``output_shape`` is the pixels ``decode`` gives per
  row.

Text-embedding cache (:meth:`FlowPipelineAdapter.cache_text_embeddings`, off by default):
with a cache of ``n`` prompts, every prompt is encoded *alone* (batch 1) and kept, keyed by
the prompt string, for the ``n`` most recently used prompts (least recently used evicted).
A row's conditioning then depends on its prompt only — never on its batch mates — so a cached
row equals a fresh encode of that prompt bitwise. Without the cache a batch is encoded in one
call of the pipeline's ``encode_prompt``, exactly as the pipeline does (rows may then differ
from single-prompt encodes by float rounding: SD3's pooled CLIP projection, ~2e-7). The cache
is emptied when the adapter moves or changes dtype (``to``, ``cuda``, ``half``, ...).
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from packaging.version import Version
from torch import nn

from ..lora import LoraSettings
from ..protocol import Conditioning

__all__ = ["FlowPipelineAdapter", "LoraDisabledView", "LoraSettings"]


def _state_dict_keeps(adapter: FlowPipelineAdapter, name: str) -> bool:
    """Whether ``name`` (relative to the adapter) belongs in the adapter's state dict."""
    if adapter.save_frozen:
        return True
    if not name.startswith("transformer."):
        return False
    return adapter.lora is None or ".lora_" in name


def _drop_frozen_entries(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if not _state_dict_keeps(module, key[len(prefix) :]):
            del state_dict[key]


def _frozen_entries_may_be_missing(module, incompatible_keys) -> None:
    # The hook runs on the root of ``load_state_dict``: missing keys carry no prefix.
    missing = incompatible_keys.missing_keys
    missing[:] = [key for key in missing if _state_dict_keeps(module, key)]


# The attention projections of both streams of an MMDiT joint-attention block (SD3, FLUX).
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class FlowPipelineAdapter(nn.Module):
    """Base of :class:`SD3Adapter`, :class:`FluxAdapter` and :class:`WanAdapter`.

    Subclasses set the class attributes below and implement ``_velocity`` (transformer call
    on validated, unpacked latents), ``_encode`` (prompts → :data:`Conditioning`) and the VAE
    scaling pair ``_to_vae`` / ``_from_vae``.
    """

    pipeline_class: ClassVar[type]
    text_encoder_names: ClassVar[tuple[str, ...]]
    tokenizer_names: ClassVar[tuple[str, ...]]
    cond_keys: ClassVar[tuple[str, ...]]
    lora_targets: ClassVar[tuple[str, ...]]

    latent_shape: tuple[int, ...]

    def __init__(
        self,
        pipeline,
        *,
        max_sequence_length: int,
        negative_prompt: str = "",
        lora: LoraSettings | None = None,
        save_frozen: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(pipeline, self.pipeline_class):
            raise TypeError(
                f"pipeline: {type(self).__name__} wraps a {self.pipeline_class.__name__}, "
                f"got {type(pipeline).__name__}"
            )
        if not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(
                f"max_sequence_length: expected a positive int, got {max_sequence_length!r}"
            )
        self.transformer = pipeline.transformer
        self.vae = pipeline.vae
        for name in self.text_encoder_names:
            setattr(self, name, getattr(pipeline, name))
        self.tokenizers = {name: getattr(pipeline, name) for name in self.tokenizer_names}
        self.scheduler_config: dict[str, Any] = dict(pipeline.scheduler.config)
        self.max_sequence_length = max_sequence_length
        self.negative_prompt = negative_prompt
        self.save_frozen = save_frozen
        self.text_cache_size = 0
        self._text_cache: OrderedDict[str, Conditioning] = OrderedDict()
        self.lora: LoraSettings | None = None
        for module in self.frozen_modules():
            module.requires_grad_(False)
            module.eval()
        self.transformer.requires_grad_(True)
        if lora is not None:
            self.add_lora(lora)
        self.register_state_dict_post_hook(_drop_frozen_entries)
        self.register_load_state_dict_post_hook(_frozen_entries_may_be_missing)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, torch_dtype: torch.dtype | None = None, **settings
    ) -> FlowPipelineAdapter:
        """Load a *local* diffusers pipeline directory (``model_index.json`` + components).

        Nothing is downloaded (``local_files_only=True``): a hub id or a missing path is a
        ``FileNotFoundError`` that says how to fetch the directory first. ``settings`` go to
        the adapter's constructor (resolution, ``lora``, ...).
        """
        path = Path(directory).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{cls.__name__}.from_pretrained: {str(directory)!r} is not a local directory. "
                "A local diffusers pipeline directory is required (hub ids are never "
                "downloaded here); fetch it once, e.g. `hf download <repo-id> --local-dir "
                "<dir>`, and pass <dir>."
            )
        index = path / "model_index.json"
        if not index.is_file():
            raise FileNotFoundError(
                f"{cls.__name__}.from_pretrained: {path} has no model_index.json; pass the "
                "root of a diffusers pipeline directory"
            )
        class_name = json.loads(index.read_text()).get("_class_name")
        if class_name != cls.pipeline_class.__name__:
            raise ValueError(
                f"{path}/model_index.json: _class_name is {class_name!r}, but "
                f"{cls.__name__} loads {cls.pipeline_class.__name__} directories"
            )
        # diffusers 0.42 renamed ``torch_dtype`` to ``dtype`` (the old name warns); earlier
        # releases know only ``torch_dtype``.
        dtype_key = "dtype" if Version(diffusers.__version__) >= Version("0.42") else "torch_dtype"
        pipeline = cls.pipeline_class.from_pretrained(
            str(path), local_files_only=True, **{dtype_key: torch_dtype}
        )
        return cls(pipeline, **settings)

    @classmethod
    def tiny(cls, seed: int = 0, **settings) -> FlowPipelineAdapter:
        """A randomly initialised tiny pipeline of this family (tests, examples)."""
        components, defaults = cls._tiny_components(seed)
        return cls(cls.pipeline_class(**components), **{**defaults, **settings})

    @classmethod
    def _tiny_components(cls, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
        raise NotImplementedError

    def as_pipeline(self):
        """A diffusers pipeline over this adapter's modules (shared, not copied), with a
        fresh scheduler from the directory's scheduler config."""
        components: dict[str, Any] = {
            "transformer": self.transformer,
            "vae": self.vae,
            "scheduler": FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config),
            **{name: getattr(self, name) for name in self.text_encoder_names},
            **self.tokenizers,
        }
        return self.pipeline_class(**components)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write the whole pipeline as a diffusers directory (what :meth:`from_pretrained`
        reads). A LoRA adapter is refused: its weights are ``state_dict()``, or
        :meth:`save_merged` writes the merged pipeline."""
        if self.lora is not None:
            raise ValueError(
                "save_pretrained: the transformer carries a LoRA; save the LoRA weights with "
                "state_dict() (the base pipeline directory is unchanged), or the merged "
                "pipeline with save_merged(directory)"
            )
        self.as_pipeline().save_pretrained(str(directory))

    def merge_lora(self) -> None:
        """Fold the LoRA into the transformer's weights in place (peft's merge,
        ``W + (alpha / rank) B A`` per target layer) and remove the LoRA layers: afterwards the
        adapter is the plain model that equals the LoRA model (to float rounding of the merged
        weights: exact up to ~1e-6 in float32; bf16 weights round the sum to bf16), with
        ``lora = None`` and the whole transformer trainable again."""
        if self.lora is None:
            raise ValueError("merge_lora: this adapter has no LoRA (lora=None)")
        self.transformer.fuse_lora(lora_scale=1.0)
        self.transformer.unload_lora()
        self.transformer.requires_grad_(True)
        self.lora = None

    def save_merged(self, directory: str | Path, *, in_place: bool = False) -> Path:
        """Write a plain diffusers pipeline directory of this model: the LoRA (if any)
        merged into the transformer (:meth:`merge_lora`), every other component as loaded.
        ``DiffusionPipeline.from_pretrained(directory)`` (and :meth:`from_pretrained`) load it
        without peft. ``in_place=False`` merges a copy of the transformer (this adapter keeps
        its LoRA; the copy costs one transformer of memory); ``in_place=True`` merges this
        adapter's own (it is the merged model afterwards). Returns ``directory``."""
        directory = Path(directory)
        if self.lora is None:
            self.save_pretrained(directory)
            return directory
        if in_place:
            self.merge_lora()
            self.save_pretrained(directory)
            return directory
        transformer = copy.deepcopy(self.transformer)
        transformer.fuse_lora(lora_scale=1.0)
        transformer.unload_lora()
        pipeline = self.as_pipeline()
        pipeline.register_modules(transformer=transformer)
        pipeline.save_pretrained(str(directory))
        return directory

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The pixels :meth:`decode` gives per row: ``(3, H, W)`` for an image model (the
        latent grid times the VAE's ``vae_scale_factor``), ``(F, 3, H, W)`` for video."""
        _, height, width = self.latent_shape
        f = self.vae_scale_factor
        return (3, height * f, width * f)

    # ------------------------------------------------------------------ trainability
    def frozen_modules(self) -> list[nn.Module]:
        return [self.vae, *(getattr(self, name) for name in self.text_encoder_names)]

    def train(self, mode: bool = True) -> FlowPipelineAdapter:
        super().train(mode)
        for module in self.frozen_modules():
            module.eval()
        return self

    def enable_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute the transformer's blocks in the backward pass instead of keeping their
        activations (diffusers' own gradient checkpointing; active in training mode): less
        memory, the same forward values and gradients."""
        if enabled:
            self.transformer.enable_gradient_checkpointing()
        else:
            self.transformer.disable_gradient_checkpointing()

    def _apply(self, fn, recurse: bool = True):
        # ``to`` / ``cuda`` / ``half`` reach every module through ``_apply``: cached rows
        # of the old device or dtype would no longer be what an encode now gives.
        self._text_cache.clear()
        return super()._apply(fn, recurse)

    def add_lora(self, settings: LoraSettings | dict) -> None:
        """Wrap the transformer's target modules with LoRA; only LoRA weights stay trainable,
        in float32 whatever the base weights' dtype."""
        from peft import LoraConfig

        settings = LoraSettings.model_validate(settings)
        if self.lora is not None:
            raise ValueError("lora: this adapter already carries a LoRA")
        config = LoraConfig(
            r=settings.rank,
            lora_alpha=settings.alpha if settings.alpha is not None else settings.rank,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules or self.lora_targets),
            init_lora_weights=True,
        )
        self.transformer.add_adapter(config)
        for name, param in self.transformer.named_parameters():
            param.requires_grad_(".lora_" in name)
            if ".lora_" in name and param.dtype != torch.float32:
                # the trained weights stay float32 under bf16 base weights (peft casts the
                # layer's input to them), so small updates are not lost to bf16 rounding
                param.data = param.data.float()
        self.lora = settings

    @contextlib.contextmanager
    def lora_disabled(self) -> Iterator[FlowPipelineAdapter]:
        """The base model (LoRA switched off) inside the block: the reference policy of a
        LoRA run. Every parameter's ``requires_grad`` is restored on exit."""
        if self.lora is None:
            raise ValueError("lora_disabled: this adapter has no LoRA (lora=None)")
        flags = [p.requires_grad for p in self.transformer.parameters()]
        self.transformer.disable_adapters()
        try:
            yield self
        finally:
            self.transformer.enable_adapters()
            for param, flag in zip(self.transformer.parameters(), flags):
                param.requires_grad_(flag)

    def lora_reference(self) -> LoraDisabledView:
        """The reference policy of a LoRA run as a VelocityModel that shares this adapter's
        weights (no copy): ``PolicyRoles(adapter, reference=False)``, then
        ``roles.reference = adapter.lora_reference()``."""
        if self.lora is None:
            raise ValueError("lora_reference: this adapter has no LoRA (lora=None)")
        return LoraDisabledView(self)

    # ------------------------------------------------------------------ VelocityModel
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        """``latents [B, *latent_shape]``, ``sigma`` float ``[B]``, ``cond`` →
        velocity ``ε - x0`` with the shape and dtype of ``latents``."""
        self._check_latents(latents, "latents")
        batch = latents.shape[0]
        if sigma.dim() != 1 or sigma.shape[0] != batch or not sigma.is_floating_point():
            raise ValueError(
                f"sigma: expected a float tensor [B] with B = {batch}, got "
                f"{tuple(sigma.shape)} {sigma.dtype}"
            )
        missing = [key for key in self.cond_keys if key not in cond]
        if missing:
            raise KeyError(
                f"cond: missing {missing}; build it with encode_prompts() or empty_condition()"
            )
        for key in self.cond_keys:
            if cond[key].shape[0] != batch:
                raise ValueError(
                    f"cond[{key!r}]: batch {cond[key].shape[0]} != latents batch {batch}"
                )
        dtype = self.transformer.dtype
        velocity = self._velocity(
            latents.to(dtype), sigma, {key: cond[key].to(dtype) for key in self.cond_keys}
        )
        return velocity.to(latents.dtype)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Prompts → conditioning with ``len(prompts)`` rows; no gradient. With the text
        cache on (:meth:`cache_text_embeddings`) each distinct prompt is encoded alone, once,
        and its row reused (module docstring)."""
        if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
            raise TypeError("prompts: expected a list of strings")
        if len(prompts) == 0:
            raise ValueError("prompts: expected at least one prompt")
        if self.text_cache_size == 0:
            with torch.no_grad():
                cond = self._encode(list(prompts))
            return {key: value.detach() for key, value in cond.items()}
        rows = {prompt: self._cached_encode(prompt) for prompt in dict.fromkeys(prompts)}
        first = rows[prompts[0]]
        return {key: torch.cat([rows[p][key] for p in prompts]) for key in first}

    def cache_text_embeddings(self, max_prompts: int) -> None:
        """Keep the conditioning of the ``max_prompts`` most recently encoded prompts
        (``0``: no cache, batches encoded in one call). Memory: one row per prompt, e.g.
        SD3 at 256 T5 tokens in bf16 ≈ 2.7 MB (``333 × 4096 × 2`` bytes)."""
        if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < 0:
            raise ValueError(f"max_prompts: expected an int >= 0, got {max_prompts!r}")
        self.text_cache_size = max_prompts
        while len(self._text_cache) > max_prompts:
            self._text_cache.popitem(last=False)

    def _cached_encode(self, prompt: str) -> Conditioning:
        """The one-row conditioning of ``prompt``, from the cache or encoded alone."""
        cache = self._text_cache
        if prompt in cache:
            cache.move_to_end(prompt)
            return cache[prompt]
        with torch.no_grad():
            row = {key: value.detach() for key, value in self._encode([prompt]).items()}
        cache[prompt] = row
        while len(cache) > self.text_cache_size:
            cache.popitem(last=False)
        return row

    def empty_condition(self, batch_size: int) -> Conditioning:
        """The unconditional rows: ``negative_prompt`` (default ``""``) encoded once and
        repeated, so every row is identical."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
        one = self.encode_prompts([self.negative_prompt])
        return {
            key: value.expand(batch_size, *value.shape[1:]).clone() for key, value in one.items()
        }

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents → pixels in ``[0, 1]`` (float32): ``[B, 3, H, W]`` or ``[B, F, 3, H, W]``.
        Differentiable in ``latents`` (the VAE itself is frozen)."""
        self._check_latents(latents, "latents")
        vae_latents = self._to_vae(latents.to(self.vae.dtype))
        pixels = self.vae.decode(vae_latents, return_dict=False)[0]
        return self._vae_pixels_to_output(pixels)

    def encode_images(
        self, pixels: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Pixels in ``[0, 1]`` (the layout :meth:`decode` returns) → latents
        ``[B, *latent_shape]`` in the transformer's scaling; the posterior mean, or a sample
        when ``generator`` is given. No gradient (for building SFT data)."""
        with torch.no_grad():
            vae_pixels = self._output_to_vae_pixels(pixels.to(self.vae.dtype)) * 2 - 1
            posterior = self.vae.encode(vae_pixels).latent_dist
            raw = posterior.mean if generator is None else posterior.sample(generator)
            latents = self._from_vae(raw)
        self._check_latents(latents, "encoded images")
        return latents

    # ------------------------------------------------------------------ helpers
    def _check_latents(self, latents: torch.Tensor, name: str) -> None:
        expected = tuple(self.latent_shape)
        if latents.dim() != 1 + len(expected) or tuple(latents.shape[1:]) != expected:
            raise ValueError(
                f"{name}: expected [B, {', '.join(map(str, expected))}] (latent_shape), got "
                f"{tuple(latents.shape)}; build the adapter with another height/width "
                "for another resolution"
            )

    def _vae_pixels_to_output(self, pixels: torch.Tensor) -> torch.Tensor:
        return (pixels.float() / 2 + 0.5).clamp(0, 1)

    def _output_to_vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        raise NotImplementedError

    def _encode(self, prompts: list[str]) -> Conditioning:
        raise NotImplementedError

    def _to_vae(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _from_vae(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def check_resolution(name: str, value: int, multiple: int) -> int:
    if not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(f"{name}: expected a positive multiple of {multiple}, got {value!r}")
    return value


class LoraDisabledView:
    """A LoRA adapter seen with its LoRA switched off: the base model, as a VelocityModel.

    It owns no weights, so ``to()`` moves nothing and ``parameters()`` are the adapter's
    (for device lookup). Call it without gradient, as a reference is scored.
    """

    def __init__(self, adapter: FlowPipelineAdapter) -> None:
        self.adapter = adapter
        self.latent_shape = adapter.latent_shape

    def __call__(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Conditioning):
        with self.adapter.lora_disabled():
            return self.adapter(latents, sigma, cond)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        return self.adapter.encode_prompts(prompts)

    def empty_condition(self, batch_size: int) -> Conditioning:
        return self.adapter.empty_condition(batch_size)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.adapter.decode(latents)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.adapter.parameters()

    def to(self, *args, **kwargs) -> LoraDisabledView:
        return self
