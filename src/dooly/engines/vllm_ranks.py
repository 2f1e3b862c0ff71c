"""One real rank of a parallel vLLM replica: vLLM's process groups at their true size, among real processes.

:class:`~dooly.engines.vllm.VLLMEngine` with ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 builds
one rank in one process, its collectives one-rank stand-ins (:mod:`dooly.engines.vllm_parallel`): what the tracer
and the profiler need. :class:`VLLMRankEngine` is the same engine (the same model directory, vLLM config, KV-cache
layout, attention metadata and step) in a process that is one of ``tp x pp`` ranks: on its first build it joins
a world of ``tp x pp`` processes as vLLM's CPU worker does (``init_worker_distributed_environment``: gloo groups,
and for each group of more than one rank vLLM's ``CpuCommunicator``, its shared-memory kernels where vLLM's build
has them), so its layers hold their shards (its stage's layers) and its collectives are the real exchanges: a
stage sends its hidden states on with vLLM's ``send_tensor_dict``, and the next receives them with
``recv_tensor_dict``. Every rank must build the same model and run the same steps in the same order, as a
replica's ranks do. Ranks are numbered as vLLM numbers them: ``stage x tp + tensor-parallel rank``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from dooly.core.errors import DoolyError
from dooly.engines.vllm import VLLMEngine


class VLLMRankEngine(VLLMEngine):
    """Rank ``rank`` of a replica of ``tp`` x ``pp`` ranks whose processes meet at ``init_method``
    (``file://...``); ``ident`` names vLLM's shared-memory segments (one set per replica on the machine)."""

    def __init__(self, dtype: str, tp: int, rank: int, init_method: str, ident: str, pp: int = 1) -> None:
        if tp * pp < 2 or not 0 <= rank < tp * pp:
            raise DoolyError(f"engine vllm: rank {rank} of a replica of {tp} x {pp} ranks")
        super().__init__(dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_stage=rank // tp)
        self.rank, self.init_method, self.ident = rank, init_method, ident

    @contextmanager
    def _parallel(self, init: bool = False) -> Iterator[None]:
        """vLLM's real groups (joined on the first build): no stand-in coordinator."""
        if init:
            self._join()
        yield

    def _join(self) -> None:
        import torch.distributed as dist
        from vllm.config import get_current_vllm_config
        from vllm.platforms import current_platform
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        if dist.is_initialized():
            return
        vc = get_current_vllm_config()  # the model's, set by build_model
        vc.parallel_config.disable_custom_all_reduce = True  # as vLLM's CPU worker sets it
        os.environ["VLLM_DIST_IDENT"] = self.ident
        current_platform.import_kernels()  # the shared-memory collectives live in vLLM's CPU extension
        init_worker_distributed_environment(vc, self.rank, self.init_method, self.rank, "gloo")

    @staticmethod
    def _received(buffers: object) -> object:
        """A later stage's inputs, received from the stage before (vLLM's ``recv_tensor_dict``)."""
        from vllm.distributed import get_pp_group
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors(get_pp_group().recv_tensor_dict())

    def backend(self) -> str:
        """The exchange of the replica's parallel group: ``vllm-shm`` (vLLM's shared-memory kernels) or ``gloo``."""
        from vllm.distributed import get_pp_group, get_tp_group
        from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

        comm = (get_tp_group() if self.tp > 1 else get_pp_group()).device_communicator
        return "vllm-shm" if isinstance(getattr(comm, "dist_module", None), _CPUSHMDistributed) else "gloo"

    def barrier(self) -> None:
        """Line every rank of the replica up (over the world's gloo group)."""
        import torch.distributed as dist
        from vllm.distributed import get_world_group

        dist.barrier(group=get_world_group().cpu_group)


__all__ = ["VLLMRankEngine"]
