"""The `torch` rollout engine: continuous batching over an HF causal LM with a prefix-shared KV cache.

It is the light default for the CPU demo, the tests, and installs without
vLLM. The policy is a `transformers` causal LM (Qwen3 / Llama architecture)
whose weights the learner pushes in memory through `update_weights` — the same
stream of `(hf_name, tensor)` pairs vLLM's `load_weights` takes, so both
engines share one weight-sync path.

Prefix reuse (docs/design.md §3.4, step 8: never re-prefill a shared prefix): every
finished sequence leaves its KV (prompt + generated tokens) in `PrefixKVCache` (prefix_cache.py),
an LRU store bounded by tokens. A new request takes the longest common token
prefix with any stored sequence, copies that much KV, and prefills only the
rest — so the next turn of a trajectory prefills only the observation, and a
continuation branched at a turn boundary prefills nothing it shares with the
bare rollout. Requests admitted together with identical prefixes (k
continuations of one node) prefill that prefix once.

Requests come in through `submit` and leave through `poll` (docs/engines.md):
each poll admits waiting requests into free rows of the running batch, samples
one token per row, retires finished rows and runs one decode forward, so a
request never waits for a batch to drain; `generate` is submit-all, poll-until-done.

Determinism: a request draws its randomness from its own `torch.Generator`
seeded with its seed, one uniform per sampled token, so its sample does not
depend on batching, on when it joined, on the order of requests, or on what
the cache held (up to float rounding of the logits, which only matters
when a uniform lands within ~1e-7 of a CDF step).

Log-probs: `Completion.logprobs[t]` is the log-prob of the sampled token under
the raw model distribution (`log_softmax(logits)`, before temperature and
top-p), matching vLLM V1's default `logprobs_mode="raw_logprobs"` (see
docs/engines.md). The learner recomputes exactly this quantity, so behaviour
and learner log-probs agree at any sampling temperature.
"""

from __future__ import annotations

import inspect
import os
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Optional, Union

import torch
import torch.nn.functional as F

from trace_mega.rollout.engines.base import ENGINES, Completion, Engine, EngineSetup, SamplingParams
from trace_mega.rollout.engines.prefix_cache import KV, CacheEntry, PrefixKVCache
from trace_mega.rollout.engines.routing import RoutingRecorder


@dataclass
class _Row:
    """One request: waiting, then a row of the running batch."""

    rid: Hashable
    prefix: list[int]
    sampling: SamplingParams
    gen: Optional[torch.Generator] = None
    """The request's own sampler stream (seeded `sampling.seed`)."""
    source: Optional[CacheEntry] = None
    """Cached sequence whose first `reuse` KV columns are copied in."""
    reuse: int = 0
    counted: int = 0
    """Prefill tokens credited as served from the cache."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    routes: list[torch.Tensor] = field(default_factory=list)
    """With routing capture: [n, MoE layers, top-k] chunks covering the prefix and the fed tokens."""


@ENGINES.register("torch")
class TorchEngine(Engine):
    """In-process engine over a `transformers` causal LM with prefix KV reuse.

    Args:
        model: an HF checkpoint directory, a `PretrainedConfig` (random init),
            or a loaded `PreTrainedModel` (used as is, not copied).
        device, dtype: where and in what precision to run (default: the model's).
        enable_prefix_caching: keep and reuse prefix KV; False prefills every
            prompt in full (the baseline the benchmark compares against).
        cache_max_tokens: bound of the prefix cache, in tokens over all layers'
            sequences (memory = tokens * layers * 2 * kv_heads * head_dim * bytes).
        max_batch_size: most sequences decoded together.
        eos_token_ids: extra stop tokens; default: the model's generation
            config / config `eos_token_id` (what vLLM also stops on).
        capture_routing: record every token's MoE experts (`Completion.routing`, engines/routing.py).
        lm_head_fp32: project the last hidden state through a float32 copy of the LM head's weight
            (`rollout.lm_head_fp32`): the logits are not rounded to a bfloat16 / float16 engine's dtype.
    """

    def __init__(
        self,
        model: Any,
        *,
        device: Union[str, torch.device, None] = None,
        dtype: Optional[torch.dtype] = None,
        enable_prefix_caching: bool = True,
        cache_max_tokens: int = 1 << 16,
        max_batch_size: int = 32,
        eos_token_ids: Optional[list[int]] = None,
        capture_routing: bool = False,
        lm_head_fp32: bool = False,
    ) -> None:
        from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

        if isinstance(model, PreTrainedModel):
            net = model
        elif isinstance(model, PretrainedConfig):
            net = AutoModelForCausalLM.from_config(model)
        else:
            net = AutoModelForCausalLM.from_pretrained(os.fspath(model), dtype=dtype or torch.float32)
        if device is not None or dtype is not None:
            net = net.to(device=device, dtype=dtype)
        text_cfg = net.config.get_text_config(decoder=True)
        if any(t != "full_attention" for t in (getattr(text_cfg, "layer_types", None) or [])):
            raise ValueError("TorchEngine supports full-attention models only (no sliding-window layers)")
        self.model = net.eval().requires_grad_(False)
        self.recorder = RoutingRecorder(net) if capture_routing else None
        # transformers >= 5.2x renamed the forward's `past_key_values` to `cache`; the cache object
        # is updated in place either way, so only the keyword differs.
        params = inspect.signature(net.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # With an fp32 head the engine runs the decoder and projects its last hidden state itself:
        # `_head32` is the head's weight in float32 [V, H], refreshed whenever the weights change
        # (as vLLM's `head_dtype`: the engine's own weight, cast up; the matmul and logits in fp32).
        self._head32: Optional[torch.Tensor] = None
        self._fp32_head = lm_head_fp32 and next(net.parameters()).dtype != torch.float32
        if self._fp32_head:
            if getattr(text_cfg, "final_logit_softcapping", None) is not None:
                raise ValueError("rollout.lm_head_fp32: the model soft-caps its logits after the head (not supported)")
            head = net.get_output_embeddings()
            if head is None or getattr(head, "bias", None) is not None:
                raise ValueError("rollout.lm_head_fp32 needs a bias-free linear output head")
            decoder_params = inspect.signature(net.get_decoder().forward).parameters
            self._decoder_cache_kw = "cache" if "cache" in decoder_params else "past_key_values"
            self._refresh_head()
        self.device = next(net.parameters()).device
        self.enable_prefix_caching = enable_prefix_caching
        self.max_batch_size = max_batch_size
        self.cache = PrefixKVCache(cache_max_tokens)
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _model_eos_ids(net)
        self._eos = set(self.eos_token_ids)
        self._offloaded = False
        # Request-level state: waiting requests, and the running batch (rows, their KV
        # [B, kv_heads, C, head_dim] per layer, attention mask [B, C], next positions [B] and the
        # logits [B, V] their next token is sampled from).
        self._ids: set[Hashable] = set()
        self._waiting: deque[_Row] = deque()
        self._rows: list[_Row] = []
        self._kv = self._mask = self._logits = self._pos = None

    @classmethod
    def launch(cls, setup: EngineSetup) -> Optional["TorchEngine"]:
        """In the learner's process and device, a network built from the policy's config (its
        weights come with the first `update_weights`)."""
        if not setup.host:
            return None
        return cls(
            setup.policy_config,
            device=setup.device,
            dtype=getattr(torch, setup.dtype),
            enable_prefix_caching=setup.rollout.enable_prefix_caching,
            eos_token_ids=setup.eos_token_ids,
            capture_routing=setup.capture_routing,
            lm_head_fp32=setup.rollout.lm_head_fp32,
        )

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model in place; unknown names or shapes are errors.

        In place (no re-allocation) so a colocated learner's stream can be
        consumed tensor by tensor without holding a second full copy. Tied
        embeddings share storage, so either name updates both. The prefix
        cache holds KV of the old weights and is dropped.
        """
        if self._ids:
            raise RuntimeError(f"update_weights: {len(self._ids)} requests are in flight; poll them to the end first")
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            dst = params[name] if name in params else _fused_expert_view(params, name)
            if dst is None:
                raise KeyError(f"update_weights: the model has no tensor {name!r}")
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)}"
                )
            dst.copy_(tensor.to(dst.device, dst.dtype))
        self.cache.clear()
        self._refresh_head()

    def _refresh_head(self) -> None:
        if self._fp32_head:
            self._head32 = self.model.get_output_embeddings().weight.detach().float()

    def sleep(self) -> None:
        """Drop the prefix cache; on an accelerator also offload the weights to host memory."""
        self.cache.clear()
        if self.device.type != "cpu":
            self.model.to("cpu")
            self._head32 = None
            self._offloaded = True
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        if self._offloaded:
            self.model.to(self.device)
            self._refresh_head()
            self._offloaded = False

    def close(self) -> None:
        self.cache.clear()

    # --------------------------------------------------------------- generation
    def generate(self, prefixes: list[list[int]], sampling: SamplingParams) -> list[Completion]:
        if sampling.max_new_tokens < 1:
            raise ValueError("generate: max_new_tokens must be >= 1")
        return self.generate_by_requests(prefixes, sampling)

    def submit(self, request_id: Hashable, prefix: list[int], sampling: SamplingParams) -> None:
        if not prefix:
            raise ValueError("submit: a request needs at least one prefix token")
        if sampling.max_new_tokens < 1:
            raise ValueError("submit: max_new_tokens must be >= 1")
        if request_id in self._ids:
            raise ValueError(f"submit: request {request_id!r} is already in flight")
        self._ids.add(request_id)
        self._waiting.append(_Row(request_id, list(prefix), sampling, self._generator(sampling.request_seed(0))))

    def in_flight(self) -> int:
        return len(self._ids)

    @torch.no_grad()
    def poll(self) -> list[tuple[Hashable, Completion]]:
        """One engine step: admit waiting requests into free batch slots (prefilled together, on
        top of their cached prefix KV), sample one token for every running row, retire the rows
        that stopped, and run one decode forward for the rest."""
        self._admit()
        if not self._rows:
            return []
        first = self._rows[0].sampling
        tok, lp = _sample(self._logits, first, [r.gen for r in self._rows])
        done, keep, fed = [], [], []
        for j, row in enumerate(self._rows):
            t = int(tok[j])
            row.tokens.append(t)
            row.logprobs.append(float(lp[j]))
            stop = t in row.sampling.stop_token_ids or t in self._eos
            if stop or len(row.tokens) >= row.sampling.max_new_tokens:
                routes = RoutingRecorder.joined(row) if self.recorder is not None else None
                if self.enable_prefix_caching:
                    seq = row.prefix + row.tokens[:-1]  # the last sampled token has no KV yet
                    self.cache.insert(seq, self._row_kv(self._kv, self._mask, j), routes)
                comp = Completion(row.tokens, row.logprobs, "stop" if stop else "length", row.counted, routes)
                done.append((row.rid, comp))
                self._ids.discard(row.rid)
            else:
                keep.append(j)
                fed.append(t)
        if len(keep) < len(self._rows):
            self._select(keep)
        if self._rows:
            self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], 1)
            self._logits = self._forward(
                self._kv,
                input_ids=torch.tensor(fed, device=self.device)[:, None],
                attention_mask=self._mask,
                position_ids=self._pos[:, None],
            )
            self._pos = self._pos + 1
            if self.recorder is not None:
                self.recorder.assign_decode(self._rows)
        return done

    def _admit(self) -> None:
        """Move waiting requests into the running batch (up to `max_batch_size` rows; requests whose
        sampling setting differs from the running rows' wait until those are done)."""
        free = self.max_batch_size - len(self._rows)
        if free <= 0 or not self._waiting:
            return
        key = (self._rows[0] if self._rows else self._waiting[0]).sampling.batch_key()
        admit, later = [], deque()
        while self._waiting:
            row = self._waiting.popleft()
            (admit if len(admit) < free and row.sampling.batch_key() == key else later).append(row)
        self._waiting = later
        if not admit:
            return
        hit_before = self._warm_shared_prefixes([r.prefix for r in admit]) if self.enable_prefix_caching else {}
        for row in admit:
            row.source, row.reuse = self._lookup(row.prefix)
            # The first of identical prefixes paid the warm-up prefill: count its tokens as fresh.
            row.counted = hit_before.pop(tuple(row.prefix), row.reuse)
        # Rows that copy from the same cached sequence side by side: the prefill pads little.
        admit.sort(key=lambda r: (r.source.eid if r.source is not None else -1, -r.reuse, len(r.prefix)))
        kv, mask, logits = self._prefill(admit)
        pos = torch.tensor([len(r.prefix) for r in admit], device=self.device)
        if not self._rows:
            self._rows, self._kv, self._mask, self._logits, self._pos = admit, kv, mask, logits, pos
            return
        # Join the running batch: both blocks end at the column of their last fed token, so the
        # shorter one is left-padded (masked) to the longer; positions are per row, pads shift nothing.
        width = max(self._mask.shape[1], mask.shape[1])
        for old, new in zip(self._kv.layers, kv.layers):
            old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
            old.values = torch.cat([_left_pad(old.values, width), _left_pad(new.values, width)])
        self._mask = torch.cat([_left_pad(self._mask, width, dim=1), _left_pad(mask, width, dim=1)])
        self._rows = self._rows + admit
        self._logits = torch.cat([self._logits, logits])
        self._pos = torch.cat([self._pos, pos])

    def _select(self, keep: list[int]) -> None:
        """Keep batch rows `keep`; drop leading columns no remaining row attends to."""
        self._rows = [self._rows[j] for j in keep]
        if not keep:
            self._kv = self._mask = self._logits = self._pos = None
            return
        sel = torch.tensor(keep, device=self.device)
        self._kv.batch_select_indices(sel)
        self._mask, self._pos = self._mask[sel], self._pos[sel]
        start = int(self._mask.any(0).long().argmax())
        if start > 0:
            self._mask = self._mask[:, start:]
            for layer in self._kv.layers:
                layer.keys, layer.values = layer.keys[:, :, start:], layer.values[:, :, start:]

    def _warm_shared_prefixes(self, prefixes: list[list[int]]) -> dict[tuple, int]:
        """Prefill once every prefix that several requests share, leaving its KV in the cache.

        All but the prefix's last token are prefilled (that one is fed per
        request to get its logits). Returns, per shared prefix, the cache hit
        it had before (what its first request is credited with).
        """
        counts: dict[tuple, int] = {}
        for p in prefixes:
            counts[tuple(p)] = counts.get(tuple(p), 0) + 1
        hit_before, todo = {}, []
        for key, k in counts.items():
            if k < 2:
                continue
            source, reuse = self._lookup(list(key))
            hit_before[key] = reuse
            if reuse < len(key) - 1:
                todo.append(_Row(None, list(key[:-1]), None, source=source, reuse=reuse))
        for start in range(0, len(todo), self.max_batch_size):
            chunk = todo[start : start + self.max_batch_size]
            cache, mask, _ = self._prefill(chunk, need_logits=False)
            for b, r in enumerate(chunk):
                routes = RoutingRecorder.joined(r) if self.recorder is not None else None
                self.cache.insert(r.prefix, self._row_kv(cache, mask, b), routes)
        return hit_before

    def _lookup(self, prefix: list[int]) -> tuple[Optional[CacheEntry], int]:
        """Cached KV usable for `prefix`: at most len-1 tokens, the last is fed to get the next logits."""
        if not self.enable_prefix_caching:
            return None, 0
        entry, n = self.cache.lookup(prefix)
        n = min(n, len(prefix) - 1)
        return (entry, n) if n > 0 else (None, 0)

    def _prefill(self, rows: list[_Row], need_logits: bool = True):
        """One forward over the uncached suffixes of `rows`, on top of their copied cached KV.

        Layout ([B, R + S] columns): a block of R = max reuse cached columns
        (row b's copied KV right-aligned in it, left pads masked out), then a
        block of S = max suffix length (suffix right-aligned). Every row's last
        prompt token lands in the last column, so decoding appends columns in
        lock step. Position ids are per row (reuse_b + j), so pads do not shift
        RoPE. Returns (DynamicCache, attention mask [B, R+S], last logits [B, V] or None).
        """
        from transformers import DynamicCache

        B = len(rows)
        R = max(r.reuse for r in rows)
        S = max(len(r.prefix) - r.reuse for r in rows)
        mask = torch.zeros(B, R + S, dtype=torch.long, device=self.device)
        ids = torch.zeros(B, S, dtype=torch.long, device=self.device)
        pos = torch.zeros(B, S, dtype=torch.long, device=self.device)
        for b, r in enumerate(rows):
            suffix = r.prefix[r.reuse :]
            mask[b, R - r.reuse : R] = 1
            mask[b, R + S - len(suffix) :] = 1
            ids[b, S - len(suffix) :] = torch.tensor(suffix, device=self.device)
            pos[b, S - len(suffix) :] = torch.arange(r.reuse, len(r.prefix), device=self.device)
        cache = DynamicCache(config=self.model.config)
        if R > 0:
            for layer in range(len(cache.layers)):
                ks, vs = [], []
                for r in rows:
                    k, v = r.source.kv[layer] if r.source is not None else self._empty_kv(layer)
                    pad = R - r.reuse
                    ks.append(F.pad(k[:, : r.reuse], (0, 0, pad, 0)))
                    vs.append(F.pad(v[:, : r.reuse], (0, 0, pad, 0)))
                cache.update(torch.stack(ks), torch.stack(vs), layer)
        logits = self._forward(cache, need_logits, input_ids=ids, attention_mask=mask, position_ids=pos)
        if self.recorder is not None:
            self.recorder.assign_prefill(rows, S)
        return cache, mask, logits

    def _forward(self, cache, need_logits: bool = True, **inputs: torch.Tensor) -> Optional[torch.Tensor]:
        """One policy forward that extends `cache` in place; the last position's logits [B, V] in float32."""
        if not self._fp32_head:
            out = self.model(**inputs, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            return out.logits[:, -1].float() if need_logits else None
        out = self.model.get_decoder()(**inputs, use_cache=True, **{self._decoder_cache_kw: cache})
        return F.linear(out.last_hidden_state[:, -1].float(), self._head32) if need_logits else None

    def _empty_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model.config.get_text_config(decoder=True)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_key_value_heads, 0, head_dim)
        dt = next(self.model.parameters()).dtype
        return torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device)

    @staticmethod
    def _row_kv(cache, mask: torch.Tensor, b: int) -> KV:
        """Row b's KV over its real (unmasked) columns, copied out of the batch: [kv_heads, L, head_dim]."""
        cols = mask[b].nonzero().squeeze(1)
        return [(layer.keys[b][:, cols].clone(), layer.values[b][:, cols].clone()) for layer in cache.layers]

    def _generator(self, seed: Optional[int]) -> torch.Generator:
        g = torch.Generator(device=self.device)
        # Unseeded requests still get independent streams, drawn from torch's global RNG.
        g.manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else seed)
        return g


def _left_pad(t: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """`t` left-padded with zeros along `dim` (the sequence axis) to `width`."""
    pad = width - t.shape[dim]
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t.new_zeros(shape), t], dim)


def _sample(logits: torch.Tensor, sampling: SamplingParams, gens: list[torch.Generator]):
    """Sample one token per row of `logits` [B, V]; returns (tokens [B], raw log-probs [B]).

    Temperature 0 is greedy. Otherwise tokens are drawn by inverse CDF (in
    vocabulary order) of softmax(logits / T) restricted to the top-p nucleus,
    with one uniform from row b's own generator, so each row's draw is fixed
    by its seed alone.
    """
    raw = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0:
        tok = logits.argmax(-1)
    else:
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            # Keep the smallest set of most likely tokens whose mass reaches top_p (vLLM's rule).
            sorted_p, order = probs.sort(-1, descending=True)
            mass_before = sorted_p.cumsum(-1) - sorted_p
            sorted_p = sorted_p.masked_fill(mass_before >= sampling.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), generator=g, device=logits.device) for g in gens])
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return tok, raw.gather(-1, tok[:, None]).squeeze(1)


def _model_eos_ids(model) -> list[int]:
    """EOS ids from the generation config, else the model config (int, list, or None)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


_EXPERT = re.compile(r"^(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _fused_expert_view(params: dict[str, torch.Tensor], name: str) -> Optional[torch.Tensor]:
    """The slice of a fused expert tensor that the per-expert HF name `name` denotes, or None.

    transformers >= 5 keeps a MoE layer's experts fused (Qwen3-MoE): `experts.gate_up_proj`
    (E, 2I, H) holds expert e's gate rows then its up rows, `experts.down_proj` (E, H, I);
    checkpoints (and the learner's export) name them per expert.
    """
    m = _EXPERT.match(name)
    if m is None:
        return None
    base, expert, kind = m.group(1), int(m.group(2)), m.group(3)
    fused = params.get(f"{base}.down_proj" if kind == "down" else f"{base}.gate_up_proj")
    if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
        return None
    if kind == "down":
        return fused[expert]
    half = fused.shape[1] // 2
    return fused[expert, :half] if kind == "gate" else fused[expert, half:]
