"""The engine interface: what the tracer, the profiler and the serving validator need from an inference engine.

An engine turns a model config into a runnable model with random weights, prepares the inputs of one forward
pass for a uniform batch of requests **with its own code** (its own KV cache object, masks and position
handling), and runs that pass. The tracer calls these methods under a ``FakeTensorMode`` with symbolic request
sizes, so nothing is allocated and the recorded shapes carry provenance; the profiler and the serving validator
call the very same methods on real tensors (for example on a one-layer model, see ``num_layers``) to set up
stateful operators such as attention over a filled KV cache ("context reuse") and to time real iterations.

Serving validation runs whole engine iterations through the engine's :class:`Executor` (``executor``), and
the memory model reads the architecture through ``architecture`` and ``num_parameters``.

Implementations, registered in :mod:`dooly.engines`: :class:`dooly.engines.hf.HFEagerEngine` (Hugging Face
transformers, eager, CPU default, CUDA when asked) and :class:`dooly.engines.vllm.VLLMEngine` (vLLM's CPU backend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dooly.core.errors import DoolyError
from dooly.core.units import dtype_bytes, size

if TYPE_CHECKING:
    from dooly.core.batch import Request, ScheduledBatch


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is active (the tracer's): what is built now allocates no memory."""
    import torch

    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


WEIGHTS_SHARE_OF_FREE = 0.9  # real weights (and KV cache) may take at most this share of the free memory


def free_memory_bytes(device: str) -> int | None:
    """Memory a new allocation can take on ``device``: CUDA's free memory, else the host's available memory
    (``MemAvailable``, within a cgroup v2 limit where one is set); None where it cannot be read."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max" and free is not None:
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


@dataclass(frozen=True)
class RequestShape:
    """One forward pass over a uniform batch (see :mod:`dooly.trace.signature` for the symbols).

    ``requests`` sequences, each computing ``tokens`` new tokens on top of ``kv_len`` already-cached ones.
    Prefill: ``kv_len=0``; chunked prefill: ``kv_len>0, tokens>1``; decode: ``tokens=1``. The fields may be torch
    ``SymInt`` s while tracing, so engines must treat them as opaque integers (no ``int()``, no value branches
    beyond what the engine itself does).
    """

    requests: int
    tokens: int
    kv_len: int = 0

    @classmethod
    def prefill(cls, requests: int, tokens: int) -> RequestShape:
        return cls(requests, tokens, 0)

    @classmethod
    def decode(cls, requests: int, kv_len: int) -> RequestShape:
        return cls(requests, 1, kv_len)


class Executor(Protocol):
    """Runs the iterations a scheduler decides on a real model, keeping every running request's KV cache."""

    def run(self, batch: ScheduledBatch) -> None:
        """Execute one iteration: each prefill chunk, then every decoding request, advancing their caches."""

    def release(self, req: Request) -> None:
        """Forget a request's cache (it finished or was preempted)."""


class Engine(ABC):
    """An inference engine backend. Subclasses set ``name`` (e.g. ``"hf-eager"``) and ``device``."""

    name: str = "engine"
    device: str = "cpu"
    # One forward per iteration over every scheduled token (vLLM), rather than one per prefill chunk plus one
    # for all the decodes (HF eager's serving loop); the predictor prices an iteration accordingly.
    flattens_batches: bool = False

    @property
    def engine_id(self) -> str:
        """What executes the ops (``"hf-eager/cpu"``), written into every :class:`~dooly.trace.signature.Signature`."""
        return f"{self.name}/{self.device}"

    @property
    def trace_context(self) -> str:
        """What a model's trace depends on besides its config (the trace cache's key): the engine, and the layout
        of a parallel replica where the engine runs one rank of one (``vllm/cpu/tp2``)."""
        return self.engine_id

    @abstractmethod
    def build_model(self, config: Mapping[str, Any], *, num_layers: int | None = None) -> Any:
        """A model with random weights from a config dict (the ``config.json`` content, ``model_type`` included).

        ``num_layers`` keeps only the first N decoder layers (per-layer shapes unchanged): a cheap real model for
        profiling one layer's operators. Under an active ``FakeTensorMode`` no weight memory is allocated.
        """

    @abstractmethod
    def prepare(self, model: Any, shape: RequestShape) -> dict[str, Any]:
        """Inputs of one forward pass for ``shape``, built with the engine's own code.

        When ``shape.kv_len`` is non-zero the engine's KV cache is filled to that length first (by the engine's
        own prefill), so attention runs exactly as it would mid-generation.
        """

    @abstractmethod
    def forward(self, model: Any, inputs: Mapping[str, Any]) -> Any:
        """Run one engine iteration (forward pass + greedy next-token pick); returns the next token ids."""

    @abstractmethod
    def advance(self, inputs: Mapping[str, Any], next_tokens: Any) -> dict[str, Any]:
        """Inputs of the following decode step (reusing the cache that ``forward`` just extended)."""

    def check_weights_fit(
        self,
        config: Mapping[str, Any],
        kv_cache_bytes: int = 0,
        name: str | None = None,
        *,
        num_layers: int | None = None,
    ) -> None:
        """Refuse, in one line, to build real weights (and a KV cache of ``kv_cache_bytes``) that the device's free
        memory cannot hold: building them would end in the kernel's OOM killer (a bare "Killed", and maybe other
        processes with it), not an error. A model cut to ``num_layers`` (smaller than the whole, which this checks)
        or built on fake tensors passes."""
        if num_layers is not None or fake_mode_active():
            return
        free = free_memory_bytes(self.device)
        if free is None:
            return
        dtype = getattr(self, "dtype", "float32")
        from dooly.core.zoo import min_parameters

        # a bound from the config first: counting builds the model on the meta device, itself slow and large for
        # a config far beyond the machine (thousands of layers)
        need, take = (min_parameters(config) or 0) * dtype_bytes(dtype), "take at least"
        if need + kv_cache_bytes <= WEIGHTS_SHARE_OF_FREE * free:
            try:
                need, take = self.num_parameters(self.architecture(config)) * dtype_bytes(dtype), "take"
            except DoolyError:  # not countable here (transformers cannot build it): building it will say why
                return
        if need + kv_cache_bytes > WEIGHTS_SHARE_OF_FREE * free:
            name = name or config.get("_name_or_path") or config.get("model_type", "the model")
            kv = f" (and its KV cache {size(kv_cache_bytes)})" if kv_cache_bytes else ""
            raise DoolyError(
                f"{name}: its weights {take} {size(need)} in {dtype}{kv} and {self.device} has "
                f"{size(free)} free; run it on a machine (or device) with more memory"
            )

    def tracing_context(self) -> AbstractContextManager[None]:
        """Entered while the tracer runs the engine on fake tensors: make the engine's code take the branches it
        takes on real tensors (engines that special-case tracing must switch that off here)."""
        return nullcontext()

    def describe(self, model: Any) -> dict[str, Any]:
        """Engine settings the model runs with (attention implementation, dtype, ...), for trace metadata."""
        return {"engine": self.engine_id}

    def executor(self, model: Any, max_num_seqs: int, max_len: int) -> Executor:
        """An executor serving up to ``max_num_seqs`` requests of at most ``max_len`` tokens on ``model``."""
        raise DoolyError(f"engine {self.name} cannot serve iterations (no executor)")

    def architecture(self, config: Mapping[str, Any]) -> Any:
        """The config as an object with transformers' attribute names (``num_hidden_layers``, ``head_dim``,
        ``get_text_config`` ...), as the memory model reads it."""
        raise DoolyError(f"engine {self.name} does not describe architectures")

    def num_parameters(self, config: Any) -> int:
        """Parameters of the model built from ``config`` (a config dict, or what ``architecture`` returned),
        tied weights counted once."""
        raise DoolyError(f"engine {self.name} does not count parameters")
