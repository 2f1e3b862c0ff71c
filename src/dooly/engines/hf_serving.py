"""The HF eager engine's serving executor: runs scheduled iterations on a transformers model.

How one iteration runs on HF eager (what the predictor's ``Batch`` must describe):

* each prefill chunk is one forward of batch 1 over its new tokens, attending to its cached prefix;
* all decoding requests run together in one forward of batch B, each with one new token; their KV caches
  are padded to the longest one and the padding is masked out (as HF ``generate`` does for a batch).

KV lives in per-layer slot tensors ``[max_num_seqs, kv_heads, max_len, head_dim]`` (a request owns a slot,
like a vLLM block table without paging). Slots are kept compact, so a decode batch over every running
request is a view of the first B slots and costs no gather. Output lengths are forced: a request stops
after exactly its ``output_tokens`` tokens, whatever the (random-weight) model would emit.
"""

from __future__ import annotations

import numpy as np
import torch

from dooly.core.batch import Request, ScheduledBatch
from dooly.core.errors import DoolyError
from dooly.engines.hf_compat import cache_kwarg


class HFExecutor:
    """Runs scheduled iterations on a transformers model, keeping each request's KV in a slot."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_len: int, seed: int = 0) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        self.model = model
        self.cache_kw = cache_kwarg(model)  # `cache`, or `past_key_values` in older releases
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.cfg = cfg
        probe = DynamicCache(config=cfg)
        if any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise DoolyError(
                f"{cfg.model_type}: serving validation supports full-attention models only "
                "(this one has sliding-window or other cache layers)"
            )
        self.num_layers = len(probe.layers)
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        dtype, self.dev = next(model.parameters()).dtype, next(model.parameters()).device
        shape = (max_num_seqs, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.dev) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.dev) for _ in range(self.num_layers)]
        self.max_len = max_len
        self.slot: dict[int, int] = {}  # request id -> slot, compact 0..n-1
        self.owner: list[int] = []  # slot -> request id
        self.rng = np.random.default_rng(seed)
        self.vocab = cfg.vocab_size
        self.tokens: dict[int, list[int]] = {}  # request id -> known token ids (prompt + generated)

    # -- slots ------------------------------------------------------------------------------------
    def _ensure_slot(self, req: Request) -> int:
        if req.id not in self.slot:
            if len(self.owner) == self.k[0].shape[0]:
                raise RuntimeError("more running requests than slots (max_num_seqs)")
            self.slot[req.id] = len(self.owner)
            self.owner.append(req.id)
        return self.slot[req.id]

    def release(self, req: Request) -> None:
        """Free a request's slot, moving the last slot into the hole so slots stay compact."""
        s = self.slot.pop(req.id, None)
        if s is None:
            return
        last = len(self.owner) - 1
        if s != last:
            moved = self.owner[last]
            for t in self.k + self.v:
                t[s].copy_(t[last])
            self.owner[s] = moved
            self.slot[moved] = s
        self.owner.pop()

    def _cache(self, slots: slice | torch.Tensor, length: int):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            kk = k[slots, :, :length] if isinstance(slots, slice) else k.index_select(0, slots)[:, :, :length]
            vv = v[slots, :, :length] if isinstance(slots, slice) else v.index_select(0, slots)[:, :, :length]
            layer.lazy_initialization(kk, vv)
            layer.keys, layer.values = kk, vv
        return cache

    # -- one iteration ----------------------------------------------------------------------------
    @torch.no_grad()  # as the engine (and generate()) runs, so the kernels are the profiled ones
    def run(self, batch: ScheduledBatch) -> None:
        for req, n in batch.prefill:
            self._prefill(req, n)
        if batch.decode:
            self._decode(batch.decode)
        if self.dev.type == "cuda":  # the iteration ends when its kernels do (a prefill chunk samples nothing)
            torch.cuda.synchronize(self.dev)

    def _known_tokens(self, req: Request) -> list[int]:
        toks = self.tokens.get(req.id)
        if toks is None:
            toks = self.rng.integers(0, self.vocab, req.prompt_tokens).tolist()
            self.tokens[req.id] = toks
        return toks

    def _prefill(self, req: Request, n: int) -> None:
        s = self._ensure_slot(req)
        c = req.computed
        if c + n > self.max_len:
            raise DoolyError(f"request {req.id} needs {c + n} cached tokens, above the engine's max_len {self.max_len}")
        ids = torch.tensor([self._known_tokens(req)[c : c + n]], device=self.dev)
        pos = torch.arange(c, c + n, device=self.dev)
        cache = self._cache(slice(s, s + 1), c)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones(1, c + n, dtype=torch.long, device=self.dev),  # the engine always passes a mask
            **{self.cache_kw: cache},
            position_ids=pos[None],
            cache_position=pos,
            use_cache=True,
            logits_to_keep=1,
        )
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            k[s, :, c : c + n] = layer.keys[0, :, c : c + n]
            v[s, :, c : c + n] = layer.values[0, :, c : c + n]
        if c + n == req.context_len:  # the prefill completes: this iteration samples a token
            self.tokens[req.id].append(int(out.logits[0, -1].argmax()))

    def _decode(self, reqs: list[Request]) -> None:
        reqs = sorted(reqs, key=lambda r: self.slot[r.id])
        slots = [self.slot[r.id] for r in reqs]
        lens = torch.tensor([r.computed for r in reqs], device=self.dev)
        longest = int(lens.max())
        if longest + 1 > self.max_len:
            raise DoolyError(f"a request needs {longest + 1} cached tokens, above the engine's max_len {self.max_len}")
        b = len(reqs)
        contiguous = slots == list(range(slots[0], slots[0] + b))
        idx = slice(slots[0], slots[0] + b) if contiguous else torch.tensor(slots, device=self.dev)
        cache = self._cache(idx, longest)
        mask = torch.zeros(b, longest + 1, dtype=torch.long, device=self.dev)
        mask[:, longest] = 1
        mask[:, :longest] = (torch.arange(longest, device=self.dev)[None, :] < lens[:, None]).long()
        ids = torch.tensor([[self.tokens[r.id][-1]] for r in reqs], device=self.dev)
        out = self.model(
            input_ids=ids,
            **{self.cache_kw: cache},
            attention_mask=mask,
            position_ids=lens[:, None],
            cache_position=torch.tensor([longest], device=self.dev),
            use_cache=True,
            logits_to_keep=1,
        )
        slot_t = torch.tensor(slots, device=self.dev)
        for layer, k, v in zip(cache.layers, self.k, self.v, strict=True):
            k[slot_t, :, lens] = layer.keys[:, :, longest]
            v[slot_t, :, lens] = layer.values[:, :, longest]
        nxt = out.logits[:, -1].argmax(-1).tolist()
        for r, t in zip(reqs, nxt, strict=True):
            self.tokens[r.id].append(int(t))
