"""KV-cache blocks sized from device memory, as vLLM sizes them.

vLLM gives the KV cache what is left of ``gpu_memory_utilization x device memory`` once the weights and the
peak activation memory of a dummy forward pass (``max_num_batched_tokens`` tokens, ``max_num_seqs``
sampled) are set aside, and cuts it into blocks of ``block_size`` tokens. One cached token costs
``2 (K and V) x layers x KV heads x head dim x KV dtype bytes``.

Everything comes from the config as the engine reads it (transformers' attribute names), with no
architecture names: layers, KV heads (grouped-query attention's ``num_key_value_heads``, else the attention
heads), head dim (``head_dim``, else hidden size / heads), and the engine's parameter count (HF eager builds
the model on the ``meta`` device, so no weight memory is allocated and tied embeddings count once).

Approximations, each on the safe side (fewer blocks than a real engine may get) unless said otherwise:

* every decoder layer is taken to cache every token. Sliding-window layers really hold at most the window
  (vLLM v1's hybrid allocator gives them fewer blocks), and layers without attention hold no KV at all; the
  count of windowed layers is reported so the reader knows where the estimate is pessimistic.
* latent-attention caches (a compressed KV per token) are not modelled; the per-head formula overstates them.
* the activation reserve is an estimate, not a profiled peak: one layer's live tensors for the token budget
  plus fp32 logits and probabilities for ``max_num_seqs`` rows. It ignores CUDA graphs and non-torch memory
  (optimistic); ``activation_gb`` replaces it with a measured figure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from dooly.core.errors import DoolyError
from dooly.core.units import GIB, dtype_bytes, size
from dooly.engines import Engine, get_engine
from dooly.simulator.scheduler import SchedulerConfig


def _text_config(hf_config: Any) -> Any:
    # multimodal configs nest the language model's config; the KV cache belongs to it
    get = getattr(hf_config, "get_text_config", None)
    return get(decoder=True) if callable(get) else hf_config


@dataclass(frozen=True)
class KVLayout:
    """What one cached token costs: K and V for every layer's KV heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_layers: int = 0  # layers with an attention window (counted as full: conservative)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def kv_layout(hf_config: Any, kv_dtype_bytes: int) -> KVLayout:
    """The KV layout of a transformers config (``PretrainedConfig`` or anything with the same attributes)."""
    t = _text_config(hf_config)
    layers = int(t.num_hidden_layers)
    heads = int(t.num_attention_heads)
    kv_heads = int(getattr(t, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(t, "head_dim", None) or t.hidden_size // heads)
    types = getattr(t, "layer_types", None)
    if types:
        sliding = sum("sliding" in str(x) for x in types)
    else:  # one window for every layer, unless the config switches it off
        window = getattr(t, "sliding_window", None)
        sliding = layers if window and getattr(t, "use_sliding_window", True) is not False else 0
    return KVLayout(layers, kv_heads, head_dim, kv_dtype_bytes, sliding)


def activation_reserve_bytes(hf_config: Any, max_num_batched_tokens: int, max_num_seqs: int, act_bytes: int) -> int:
    """Estimated peak activation memory of one forward pass at the token budget (see the module docstring).

    Per token, one layer holds its residual, normed input, attention output and projections (about 4 hidden
    widths plus the K/V projections) and the MLP's gate, up and activated intermediates (3 intermediate
    widths, times the experts each token visits in a mixture of experts); sampling holds fp32 logits and
    probabilities over the vocabulary for each sequence."""
    t = _text_config(hf_config)
    hidden = int(t.hidden_size)
    layout = kv_layout(hf_config, act_bytes)
    inter = int(getattr(t, "intermediate_size", None) or 4 * hidden)
    inter *= int(getattr(t, "num_experts_per_tok", None) or 1)
    per_token = (4 * hidden + 2 * layout.num_kv_heads * layout.head_dim + 3 * inter) * act_bytes
    sampled = min(max_num_seqs, max_num_batched_tokens)
    logits = sampled * int(t.vocab_size) * 4 * 2
    return max_num_batched_tokens * per_token + logits


@dataclass(frozen=True)
class MemoryPlan:
    """How one replica's memory splits, and the KV blocks that result."""

    model: str
    memory_bytes: int
    utilization: float
    weight_bytes: int
    activation_bytes: int
    layout: KVLayout
    block_size: int
    num_blocks: int

    @property
    def budget_bytes(self) -> int:
        return int(self.memory_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weight_bytes - self.activation_bytes

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        lay = self.layout
        text = (
            f"{self.model}: {self.memory_bytes / GIB:g} GiB x {self.utilization:g} = {size(self.budget_bytes)}"
            f" - weights {size(self.weight_bytes)} - activations {size(self.activation_bytes)}"
            f" = KV {size(self.kv_bytes)} at {lay.bytes_per_token / 1024:g} KiB/token"
            f" ({lay.num_layers} layers x {lay.num_kv_heads} KV heads x {lay.head_dim} x 2 x {lay.dtype_bytes} B)"
            f" -> {self.num_blocks} blocks of {self.block_size} tokens ({self.tokens} tokens)"
        )
        if lay.sliding_layers:
            text += f"; {lay.sliding_layers} sliding-window layers counted as full (a lower bound)"
        return text


class MemoryModel:
    """One model on one device: derives a :class:`MemoryPlan` (hence ``num_kv_blocks``) for any engine config.

    The parameter count and KV layout are computed once; the activation reserve depends on the token budget
    and sequence limit, so a configuration sweep gets a block count per configuration, as vLLM would."""

    def __init__(
        self,
        config: Mapping[str, Any] | Any,
        memory_gb: float,
        gpu_memory_utilization: float = 0.9,
        dtype: str = "bfloat16",
        kv_cache_dtype: str = "auto",
        activation_gb: float | None = None,
        name: str = "model",
        num_params: int | None = None,
        engine: Engine | None = None,
    ) -> None:
        if not memory_gb > 0:
            raise DoolyError(f"{name}: device memory must be > 0 GiB, got {memory_gb}")
        if not 0 < gpu_memory_utilization <= 1:
            raise DoolyError(f"{name}: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if activation_gb is not None and activation_gb < 0:
            raise DoolyError(f"{name}: activation reserve must be >= 0 GiB, got {activation_gb}")
        self.engine = engine or get_engine(dtype=dtype)
        if isinstance(config, Mapping):
            config = self.engine.architecture(config)
        self.hf_config = config
        self.name = name
        self.memory_bytes = int(memory_gb * GIB)
        self.utilization = gpu_memory_utilization
        self.act_bytes = dtype_bytes(dtype)
        kv_bytes = self.act_bytes if kv_cache_dtype == "auto" else dtype_bytes(kv_cache_dtype)
        self.layout = kv_layout(config, kv_bytes)
        self.activation_gb = activation_gb
        self._num_params = num_params

    @cached_property
    def num_params(self) -> int:
        return self._num_params if self._num_params is not None else self.engine.num_parameters(self.hf_config)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.act_bytes

    def plan(self, block_size: int = 16, max_num_batched_tokens: int = 2048, max_num_seqs: int = 64) -> MemoryPlan:
        """The block count for these engine limits; DoolyError when the model or its activations do not fit."""
        budget = int(self.memory_bytes * self.utilization)
        mem = f"{size(budget)} ({self.utilization:g} x {self.memory_bytes / GIB:g} GiB)"
        if self.weight_bytes >= budget:
            raise DoolyError(f"{self.name}: model weights {size(self.weight_bytes)} exceed memory {mem}")
        if self.activation_gb is not None:
            act = int(self.activation_gb * GIB)
        else:
            act = activation_reserve_bytes(self.hf_config, max_num_batched_tokens, max_num_seqs, self.act_bytes)
        blocks = (budget - self.weight_bytes - act) // (self.layout.bytes_per_token * block_size)
        if blocks < 1:
            raise DoolyError(
                f"{self.name}: model weights {size(self.weight_bytes)} and activations {size(act)}"
                f" (max_num_batched_tokens={max_num_batched_tokens}) leave no KV-cache block in memory {mem}"
            )
        return MemoryPlan(
            self.name, self.memory_bytes, self.utilization, self.weight_bytes, act, self.layout, block_size, blocks
        )

    def plan_for(self, cfg: SchedulerConfig) -> MemoryPlan:
        return self.plan(cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs)

    def configure(self, cfg: SchedulerConfig) -> SchedulerConfig:
        """`cfg` with ``num_kv_blocks`` derived from memory."""
        return replace(cfg, num_kv_blocks=self.plan_for(cfg).num_blocks)


def cpu_kv_blocks(hf_config: Any, kvcache_space_gb: float, block_size: int, kv_dtype_bytes: int) -> int:
    """KV blocks of vLLM's CPU backend: ``VLLM_CPU_KVCACHE_SPACE`` GiB set aside for the cache (no memory
    profiling: weights and activations live outside it), cut into blocks of ``block_size`` tokens."""
    layout = kv_layout(hf_config, kv_dtype_bytes)
    blocks = int(kvcache_space_gb * GIB) // (layout.bytes_per_token * block_size)
    if blocks < 1:
        raise DoolyError(
            f"a KV cache of {kvcache_space_gb:g} GiB holds no block of {block_size} tokens "
            f"at {layout.bytes_per_token} B/token"
        )
    return blocks


@dataclass(frozen=True)
class KVSizing:
    """Where a simulation's KV blocks come from: an explicit count, device memory, or the default."""

    config: SchedulerConfig  # with ``num_kv_blocks`` set
    plan: MemoryPlan | None  # the memory split, when device memory was given
    explicit: bool  # the block count was given explicitly (memory, if any, only reported beside it)

    @property
    def per_config(self) -> bool:
        """Whether a sweep derives each configuration's blocks from memory (its own activation reserve)."""
        return self.plan is not None and not self.explicit


DEFAULT_KV_BLOCKS = 4096


def size_kv_cache(cfg: SchedulerConfig, memory: MemoryModel | None, kv_blocks: int | None) -> KVSizing:
    """``cfg`` with its KV blocks: ``kv_blocks`` when given, else derived from ``memory``, else the default."""
    cfg = replace(cfg, num_kv_blocks=kv_blocks or DEFAULT_KV_BLOCKS)
    if memory is None:
        return KVSizing(cfg, None, kv_blocks is not None)
    plan = memory.plan_for(cfg)
    if kv_blocks is None:
        cfg = replace(cfg, num_kv_blocks=plan.num_blocks)
    return KVSizing(cfg, plan, kv_blocks is not None)
