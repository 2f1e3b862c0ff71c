"""Hugging Face transformers in eager mode: the embedded default engine (CPU by default, CUDA when asked).

Everything here is architecture-agnostic: the model class comes from ``AutoModelForCausalLM`` and the config's
``model_type``, the KV cache is transformers' own ``DynamicCache`` (sliding-window layers included), masks and
positions are computed by the model's own code. Engine settings are transformers' defaults (attention
implementation ``sdpa`` where the model supports it, otherwise ``eager``; experts implementation ``grouped_mm``
where the model has one) and, like ``generate()``, only the last position's logits are computed
(``logits_to_keep=1``) and the next token is picked greedily, under ``torch.no_grad()`` as ``generate()`` runs (so
composite ops such as ``linear`` and ``scaled_dot_product_attention`` decompose into the kernels that really run).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dooly.core.errors import DoolyError, one_line
from dooly.engines.base import Engine, RequestShape, fake_mode_active
from dooly.engines.hf_compat import cache_kwarg


@contextmanager
def _no_init(skip: bool) -> Iterator[None]:
    if not skip:
        yield
        return
    from transformers.initialization import no_init_weights

    with no_init_weights():
        yield


def _config_errors() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config it will not accept: its own checks and, since configs became strict
    dataclasses, huggingface_hub's validators (not ValueErrors)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: no strict configs
        return (ValueError, KeyError, TypeError)
    return (ValueError, KeyError, TypeError, StrictDataclassError)

# config.json keys that describe a checkpoint or a hub repo rather than the architecture
_NOT_ARCHITECTURE = {
    "architectures",
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "auto_map",
    "quantization_config",
    "_dooly",
}


def causal_lm_architectures(config: Mapping[str, Any]) -> list[str]:
    """The config's ``architectures``, else the causal-LM class transformers maps its ``model_type`` to (the
    class this engine builds). vLLM needs it in a model directory: without it, it loads the bare decoder."""
    if config.get("architectures"):
        return list(config["architectures"])
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
    if arch is None:
        raise DoolyError(f"transformers maps no causal-LM class to model_type {config.get('model_type')!r}")
    return [arch]


def _is_zero(x: Any) -> bool:
    """True only for a concrete 0 (a symbolic size is never assumed to be zero)."""
    return isinstance(x, int) and x == 0


class HFEagerEngine(Engine):
    """transformers eager engine. ``dtype`` is the weight/activation dtype of every model it builds."""

    name = "hf-eager"

    def __init__(self, device: str = "cpu", dtype: str = "bfloat16", attn_implementation: str | None = None) -> None:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise DoolyError("engine hf-eager: device 'cuda' requested but torch sees no CUDA device")
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise DoolyError(f"engine hf-eager: unknown dtype {dtype!r}")
        self.device = device
        self.dtype = dtype
        self.attn_implementation = attn_implementation  # None: transformers' default for the model

    # -- config / model -------------------------------------------------------------------------------------

    def hf_config(self, config: Mapping[str, Any], *, num_layers: int | None = None) -> Any:
        """A transformers ``PretrainedConfig`` from a config dict (``model_type`` selects the class); with
        `num_layers`, of its first that many decoder layers (`dooly.core.zoo.at_depth`)."""
        from transformers import AutoConfig

        if num_layers is not None:
            from dooly.core.zoo import at_depth
            from dooly.core.zoo import num_layers as layers_of

            total = layers_of(config) or self.hf_config(config).num_hidden_layers  # the class's default depth
            if not 1 <= num_layers <= total:
                raise DoolyError(f"num_layers must be in 1..{total}, got {num_layers}")
            config = at_depth(config, num_layers) or {**config, "num_hidden_layers": num_layers}
        fields = {k: copy.deepcopy(v) for k, v in config.items() if k not in _NOT_ARCHITECTURE}
        model_type = fields.pop("model_type", None)
        if not model_type:
            raise DoolyError("model config has no 'model_type'")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = AutoConfig.for_model(model_type, **fields)
        except _config_errors() as exc:
            raise DoolyError(f"transformers cannot build a {model_type!r} config: {one_line(exc, lines=2)}") from None
        return cfg

    def build_model(self, config: Mapping[str, Any], *, num_layers: int | None = None) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        cfg = self.hf_config(config, num_layers=num_layers)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, self.dtype)}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        # on fake tensors (the tracer) weight values do not exist: skip their initialisation, whose data-dependent
        # draws (a vision tower's truncated normal) a fake tensor cannot run; weights are still tied below
        fake = fake_mode_active()
        self.check_weights_fit(config, num_layers=num_layers)
        try:
            with torch.device(self.device), warnings.catch_warnings(), _no_init(fake):
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_config(cfg, **kwargs)
            if fake:
                model.tie_weights()
        except ImportError as exc:  # a package the architecture's code imports is not installed (a vision tower's timm)
            raise DoolyError(f"transformers cannot build {cfg.model_type!r} here: {one_line(exc, lines=2)}") from None
        except (*_config_errors(), AttributeError, AssertionError) as exc:  # a sub-config lacking a field it reads,
            # or a constructor's own assertion on the config (reformer wants is_decoder)
            why = one_line(exc, lines=2)
            raise DoolyError(f"transformers cannot build a causal LM for {cfg.model_type!r}: {why}") from None
        model.eval()
        return model

    @contextmanager
    def tracing_context(self) -> Iterator[None]:
        # transformers takes a "tracing" path when it sees a FakeTensor (always build the attention mask, never read
        # its values, repeat_kv instead of sdpa's GQA). A real run reads the mask (``mask.all()``) and skips it;
        # the tracer supplies those reads from real values, so let transformers treat fake tensors as real ones.
        from transformers.utils import import_utils

        original = import_utils.is_fake_tensor
        import_utils.is_fake_tensor = lambda x: False
        try:
            yield
        finally:
            import_utils.is_fake_tensor = original

    def architecture(self, config: Mapping[str, Any]) -> Any:
        return self.hf_config(config)

    def num_parameters(self, config: Any) -> int:
        """Parameters of the causal LM built on the meta device (no weight memory; tied weights count once)."""
        import torch
        from transformers import AutoModelForCausalLM

        arch = config if not isinstance(config, Mapping) else self.hf_config(config)
        try:
            with torch.device("meta"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_config(arch)
        except (ValueError, KeyError, TypeError) as exc:
            raise DoolyError(f"cannot build {getattr(arch, 'model_type', '?')!r} to count parameters: {exc}") from None
        return sum(p.numel() for p in model.parameters())

    def executor(self, model: Any, max_num_seqs: int, max_len: int) -> Any:
        from dooly.engines.hf_serving import HFExecutor

        return HFExecutor(model, max_num_seqs, max_len)

    def describe(self, model: Any) -> dict[str, Any]:
        cfg = model.config
        return {
            "engine": self.engine_id,
            "dtype": self.dtype,
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
            "model_class": type(model).__name__,
        }

    # -- one forward pass -----------------------------------------------------------------------------------

    _cache_kwarg = staticmethod(cache_kwarg)  # `cache`, or `past_key_values` in older transformers releases

    def prepare(self, model: Any, shape: RequestShape) -> dict[str, Any]:
        import torch
        from transformers import DynamicCache

        dev = torch.device(self.device)
        cache = DynamicCache(config=model.config)
        cache_kw = self._cache_kwarg(model)
        if not _is_zero(shape.kv_len):
            # fill the cache with the engine's own prefill: exactly what the cache holds mid-generation
            ids = torch.zeros(shape.requests, shape.kv_len, dtype=torch.long, device=dev)
            mask = torch.ones(shape.requests, shape.kv_len, dtype=torch.long, device=dev)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        inputs: dict[str, Any] = {
            "input_ids": torch.zeros(shape.requests, shape.tokens, dtype=torch.long, device=dev),
            "attention_mask": torch.ones(shape.requests, shape.kv_len + shape.tokens, dtype=torch.long, device=dev),
            cache_kw: cache,
            "use_cache": True,
        }
        if "logits_to_keep" in inspect.signature(model.forward).parameters:
            inputs["logits_to_keep"] = 1  # as generate() does: only the last position feeds the sampler
        return inputs

    def forward(self, model: Any, inputs: Mapping[str, Any]) -> Any:
        import torch

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(**inputs)
            return out.logits[:, -1, :].argmax(dim=-1)

    def advance(self, inputs: Mapping[str, Any], next_tokens: Any) -> dict[str, Any]:
        import torch

        nxt = dict(inputs)
        nxt["input_ids"] = next_tokens.reshape(-1, 1)
        mask = inputs["attention_mask"]
        nxt["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        return nxt


__all__ = ["HFEagerEngine", "RequestShape"]
