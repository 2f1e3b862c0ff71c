"""Device layouts of a fixed device count: tensor parallel x pipeline parallel x replicas, as vLLM accepts them.

For ``D`` devices every ``(tp, pp, replicas)`` with ``tp * pp * replicas == D`` is a layout. vLLM refuses some
before it builds anything, and :func:`vllm_refusal` says why in one line, with vLLM's own rule:

* the attention heads must divide by ``tp`` (``ModelConfig.verify_with_parallel_config``);
* the KV heads must divide by ``tp``, or ``tp`` by the KV heads (then each KV head is repeated on ``tp / kv``
  ranks: ``QKVParallelLinear``);
* the MLP's intermediate size must divide by ``tp`` (the column-parallel layers ``divide`` it);
* a pipeline needs at least one layer per stage. vLLM splits the layers as :func:`pp_partition` does
  (``get_pp_indices``: an even share, the remainder one layer each to the stages before the last), so a layer
  count that does not divide by ``pp`` is accepted, unevenly.

Which of the accepted layouts fit in device memory is the memory model's question, not this module's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dooly.core.errors import DoolyError
from dooly.core.zoo import num_layers


@dataclass(frozen=True)
class Layout:
    """``replicas`` replicas, each of ``pp`` pipeline stages of ``tp`` tensor-parallel devices."""

    tp: int
    pp: int
    replicas: int

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def devices_per_replica(self) -> int:
        return self.tp * self.pp

    def label(self) -> str:
        """``TP4xPP2``, ``TP2 x4 replicas``: the replica's shape, then how many."""
        shape = f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")
        return shape + (f" x{self.replicas}" if self.replicas > 1 else "")


def _text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def pp_partition(layers: int, pp: int) -> list[int]:
    """Layers per stage as vLLM splits them (``vllm.distributed.utils.get_pp_indices`` without
    ``VLLM_PP_LAYER_PARTITION``)."""
    parts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        parts[-i] += 1
    return parts


def vllm_refusal(config: Mapping[str, Any], tp: int, pp: int) -> str:
    """Why vLLM would refuse ``config`` at this layout, in one line ("" when it accepts it)."""
    t = _text(config)
    heads = t.get("num_attention_heads")
    kv = t.get("num_key_value_heads") or heads
    inter = t.get("intermediate_size")
    if isinstance(heads, int) and heads % tp:
        return f"attention heads ({heads}) not divisible by TP {tp}"
    if isinstance(kv, int) and tp > 1 and (kv % tp if kv >= tp else tp % kv):
        return f"KV heads ({kv}) and TP {tp}: neither divides the other"
    if isinstance(inter, int) and inter % tp:
        return f"intermediate size ({inter}) not divisible by TP {tp}"
    layers = num_layers(config)
    if pp > 1 and layers is not None and layers < pp:
        return f"{layers} layers cannot fill {pp} pipeline stages"
    return ""


def enumerate_layouts(devices: int, max_pp: int | None = None) -> list[Layout]:
    """Every layout of ``devices`` devices, widest tensor parallelism first, then fewer stages."""
    if devices < 1:
        raise DoolyError(f"a layout needs at least one device, got {devices}")
    out = []
    for per_replica in range(devices, 0, -1):
        if devices % per_replica:
            continue
        for pp in range(1, per_replica + 1):
            if per_replica % pp or (max_pp is not None and pp > max_pp):
                continue
            out.append(Layout(per_replica // pp, pp, devices // per_replica))
    return sorted(out, key=lambda lay: (-lay.devices_per_replica, lay.pp))
