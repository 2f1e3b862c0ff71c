"""One rank of a tensor- and pipeline-parallel vLLM replica, built and run in one process.

vLLM's parallel layers size their shards from its process groups (``get_tp_group().world_size`` and
``rank_in_group``; the layers a pipeline stage holds from ``get_pp_group()``), and issue their collectives through
those groups' methods (``tensor_model_parallel_all_reduce`` is ``get_tp_group().all_reduce``). So
:func:`parallel_groups` puts, for as long as a model is built or run, a group that says it is rank ``r`` of ``N``
in place of vLLM's one-rank tensor- and pipeline-parallel groups (the real groups stay set up underneath, for
whatever else asks vLLM's distributed state). The shards then come from vLLM's own code, and each collective runs
as a ``dooly_vllm`` op whose single-rank kernel returns what the rank would receive (an all-reduce: a copy of the
same shape; an all-gather: ``N`` times the size along its dimension), so the tracer records it as one signature
over its tensor (its byte count) and the group size:

* ``dooly_vllm::all_reduce(x, group_size)``, ``all_gather(x, dim, group_size)``,
  ``reduce_scatter(x, dim, group_size)``, ``gather(x, dim, group_size)`` (on the destination rank);
* ``dooly_vllm::send(x, group_size)``: a pipeline stage handing a tensor to the next (a copy of it);
  ``dooly_vllm::recv(x, group_size)``: a stage receiving one (``x`` gives the shape; its copy is what arrived).

A vocabulary-parallel embedding masks the token ids outside its shard with a function vLLM compiles into one
kernel (``get_masked_input_and_mask``); a dispatch mode would see (and price) its dozen eager ops instead, so while
observed it runs as ``dooly_vllm::vocab_parallel_mask``, whose kernel is vLLM's compiled function.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_LIB: Any = None
_SIGNATURES = {
    "all_reduce": "all_reduce(Tensor x, int group_size) -> Tensor",
    "all_gather": "all_gather(Tensor x, int dim, int group_size) -> Tensor",
    "reduce_scatter": "reduce_scatter(Tensor x, int dim, int group_size) -> Tensor",
    "gather": "gather(Tensor x, int dim, int group_size) -> Tensor",
    "send": "send(Tensor x, int group_size) -> Tensor",
    "recv": "recv(Tensor x, int group_size) -> Tensor",
    "vocab_parallel_mask": "vocab_parallel_mask(Tensor input, int org_start, int org_end, int padding, "
    "int added_start, int added_end) -> (Tensor, Tensor)",
}


def _gathered(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """What an all-gather of ``x`` over ``n`` ranks hands each rank: ``n`` blocks along ``dim`` (this rank's data
    in each, as a one-rank stand-in)."""
    return torch.cat([x] * n, dim=dim)


def _scattered(x: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    return x.chunk(n, dim=dim)[0].clone()


def install() -> None:
    """Define the collective ops (once); the ``dooly_vllm`` library is :mod:`dooly.engines.vllm_ops`'s."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("dooly_vllm", "FRAGMENT")
    for schema in _SIGNATURES.values():
        lib.define(schema)
    kernels = {
        "all_reduce": lambda x, n: x.clone(),
        "all_gather": _gathered,
        "reduce_scatter": _scattered,
        "gather": _gathered,
        "send": lambda x, n: x.clone(),
        "recv": lambda x, n: x.clone(),
    }
    for name, fn in kernels.items():
        lib.impl(name, fn, "CPU")
        # the fake runs the same shape arithmetic on fake tensors (sizes stay symbolic)
        torch.library.register_fake(f"dooly_vllm::{name}", fn, lib=lib)
    _route_vocab_mask(lib)
    _LIB = lib


def _route_vocab_mask(lib: Any) -> None:
    """vLLM's compiled vocabulary mask as one op while observed (its eager body computes the fake's result)."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    from dooly.engines.vllm_ops import observed

    compiled = vpe.get_masked_input_and_mask
    eager = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    lib.impl("vocab_parallel_mask", lambda *a: compiled(*a), "CPU")
    torch.library.register_fake("dooly_vllm::vocab_parallel_mask", lambda *a: eager(*a), lib=lib)

    def masked(input_: torch.Tensor, *bounds: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _ops().vocab_parallel_mask(input_, *bounds) if observed(input_) else compiled(input_, *bounds)

    vpe.get_masked_input_and_mask = masked


def _ops() -> Any:
    return torch.ops.dooly_vllm


def _coordinator_class() -> type:
    """A ``GroupCoordinator`` of ``world_size`` ranks whose collectives are the ``dooly_vllm`` ops (made lazily:
    vLLM is imported only by its engine)."""
    from vllm.distributed.parallel_state import GroupCoordinator

    class FakeGroup(GroupCoordinator):
        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            return _ops().all_reduce(input_, self.world_size)

        def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return _ops().all_gather(input_, dim % input_.dim(), self.world_size)

        def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return _ops().reduce_scatter(input_, dim % input_.dim(), self.world_size)

        def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
            out = _ops().gather(input_, dim % input_.dim(), self.world_size)
            return out if self.rank_in_group == dst else None

        def send_tensor_dict(self, tensor_dict: dict[str, Any], dst: int | None = None, *a: Any, **k: Any) -> None:
            # vLLM's CPU communicator sends each tensor of a stage's output whole
            for v in tensor_dict.values():
                if isinstance(v, torch.Tensor):
                    _ops().send(v, self.world_size)

    return FakeGroup


_FAKE_CLASS: type | None = None


def fake_group(real: Any, world_size: int, rank: int = 0) -> Any:
    """``real`` (a one-rank ``GroupCoordinator``) as rank ``rank`` of ``world_size``: the same process groups
    underneath, no device communicator, collectives routed through the ``dooly_vllm`` ops."""
    global _FAKE_CLASS
    if _FAKE_CLASS is None:
        _FAKE_CLASS = _coordinator_class()
    group = object.__new__(_FAKE_CLASS)
    group.__dict__.update(real.__dict__)
    group.world_size = world_size
    group.rank_in_group = group.rank = rank  # is_first_rank/is_last_rank compare the global rank with `ranks`
    group.ranks = list(range(world_size))
    group.device_communicator = None
    group.use_custom_op_call = False
    group.use_cpu_custom_send_recv = False
    group.mq_broadcaster = None
    return group


@contextmanager
def parameter_attributes_on_fakes() -> Iterator[None]:
    """While a model is built: a vLLM parameter (``ModelWeightParameter`` ...) made from a fake tensor keeps the
    attributes it is made with. torch hands back the fake tensor itself for a ``Parameter`` subclass of one, so the
    class's ``__init__`` never runs and its ``weight_loader`` is missing, which vLLM's sharded layers (the Mamba2
    mixer at TP > 1) delete and replace while they are built."""
    from vllm.model_executor.parameter import BasevLLMParameter

    original = BasevLLMParameter.__dict__["__new__"]

    def __new__(cls: type, data: Any = None, **kwargs: Any) -> Any:
        t = original(cls, data, **kwargs)
        if not isinstance(t, cls):
            for k, v in kwargs.items():
                setattr(t, k, v)
        return t

    BasevLLMParameter.__new__ = __new__
    try:
        yield
    finally:
        BasevLLMParameter.__new__ = original


def received(buffers: Any) -> Any:
    """A later pipeline stage's inputs (vLLM's ``IntermediateTensors``), each received through
    ``dooly_vllm::recv`` into its buffer (what vLLM's ``recv_tensor_dict`` allocates)."""
    from vllm.distributed import get_pp_group
    from vllm.sequence import IntermediateTensors

    n = get_pp_group().world_size
    return IntermediateTensors({k: _ops().recv(v, n) for k, v in buffers.tensors.items()})


@contextmanager
def parallel_groups(tp: int, pp: int, pp_rank: int = 0) -> Iterator[None]:
    """vLLM's tensor- and pipeline-parallel groups say this process is rank 0 of ``tp`` and stage ``pp_rank`` of
    ``pp`` while inside (vLLM's one-rank groups must be set up already); the real ones are back after."""
    from vllm.distributed import parallel_state as ps

    install()
    before = ps._TP, ps._PP
    try:
        ps._TP = fake_group(before[0], tp) if tp > 1 else before[0]
        ps._PP = fake_group(before[1], pp, pp_rank) if pp > 1 else before[1]
        yield
    finally:
        ps._TP, ps._PP = before


__all__ = ["fake_group", "install", "parallel_groups", "parameter_attributes_on_fakes", "received"]
