"""The ``hf`` rollout engine: batched ``generate`` on the policy module itself, or on a copy of it.

Images of a prompt are preprocessed once (the :class:`EncodedPrompt`) and, on an unsharded model
(``prefill_once``), each prompt's prefill runs once: one forward over the left-padded prompts (the vision
tower once per unique prompt, all but the last prompt token) fills a KV cache, which becomes the cache of the
n samples (with Qwen-VL's m-rope offsets) without being copied n times (``group_forward.SharedPrefixLayer``:
the prompt's keys once, read once per prompt at each decode step, the samples' own keys filled in place), and
``generate`` continues from it, so the prompt and its images are computed and held once per group instead of n
times.
Sharded models (FSDP2, ZeRO-3) generate through the root module in lockstep (``synced_gpus``) on the
prompts repeated n times instead.

The inference copy (``rollout.hf.inference_copy``): a plain, unwrapped model loaded from the policy's
folder in the rollout dtype (bf16 on CUDA), refreshed after each update from ``Strategy.full_params()``
(the stream the vllm engine reads) and freed while the policy trains (``sleep``: moved to page-locked CPU
memory, kept or dropped, as ``rollout.hf.sleep_level`` says). It generates instead of the training module: no
FSDP2 / ZeRO-3 gather and no fp32 -> bf16 cast per decode step, no lockstep between ranks (each rank holds a whole
copy), prefill once per prompt everywhere.

Compiled decode (``rollout.hf.compile``, CUDA with the copy by default): the prefill's cache is copied into a
:class:`StaticCache` of a bucketed length, on which ``generate`` compiles the decode step (torch.compile,
CUDA graphs) by its own criteria; on CPU the same static cache runs eagerly and samples the same tokens. The
static caches are kept and reused from rollout to rollout while the weights stay put (``sleep_level=0``), so
the captured decode step replays at every rollout instead of being recorded again.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from transformers import StaticCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from data_pipelines.collate import EncodedPrompt, collate_prompts, tokenizer_of
from vlrft.config import ConfigError, option
from vlrft.models.cpu_matmul import use_onednn_linears, uses_onednn
from vlrft.models.group_forward import share_prompt_cache, use_packed_attention
from vlrft.models.loading import load_model
from vlrft.rollout.base import Rollout, SamplingParams, vision_token_ids

# later transformers 5 releases renamed the KV cache from past_key_values to cache; the old name still works there but
# warns on every generate call (a FutureWarning and a log line), so the cache goes by the name it has
CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


@dataclass
class HFEngineConfig:
    """The ``hf`` engine (``rollout.engine=hf``)."""

    inference_copy: str = option(
        "auto",
        "generate with a plain copy of the policy in the rollout dtype, refreshed from the weight stream after each "
        "update and freed during it as sleep_level says (no parameter gather per decode step, no lockstep between "
        "ranks); "
        "auto: on where the policy computes on CUDA or a strategy shards parameters, off on one CPU process (where it "
        "only costs memory)",
        choices=("auto", "on", "off"),
    )
    dtype: str = option(
        "auto",
        "the copy's dtype (auto: bfloat16 where the policy computes on CUDA, the policy's on CPU)",
        choices=("auto", "float32", "bfloat16"),
    )
    sleep_level: int = option(
        1,
        "the inference copy while the policy trains: 0 keep it on the GPU (no transfer, it holds its memory through "
        "the update), 1 move it to page-locked CPU memory and back (on a GPU; buffers made at the first sleep), 2 "
        "drop its weights (any device; the weight stream then re-sends every parameter after the update, frozen ones "
        "too)",
        choices=(0, 1, 2),
    )
    compile: str = option(
        "auto",
        "decode with a static KV cache, each decode step compiled and captured as a CUDA graph (torch.compile "
        "through transformers' generate; CUDA only, eager elsewhere: on makes CPU use the static cache too); auto: on "
        "where the policy computes on CUDA, with the inference copy",
        choices=("auto", "on", "off"),
    )

    # ``device`` below: where the policy computes (the strategy's device), not whether the machine has a GPU: a
    # policy on the CPU of a machine with CUDA gets what a CPU machine gives it (its dtype, no copy, eager decode)

    def copy_dtype(self, policy_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        return torch.bfloat16 if device.type == "cuda" else policy_dtype

    def wants_copy(self, sharded: bool, device: torch.device) -> bool:
        """Whether the engine generates with a copy (``sharded``: the strategy shards parameters)."""
        if self.inference_copy != "auto":
            return self.inference_copy == "on"
        return device.type == "cuda" or sharded

    def wants_static_cache(self, copy: bool, device: torch.device) -> bool:
        """Whether an unsharded engine decodes with a static cache (compiled on CUDA by ``generate`` itself);
        ``copy``: it generates with the inference copy (auto never compiles a wrapped training module)."""
        return self.compile == "on" or (self.compile == "auto" and device.type == "cuda" and copy)


class HFRolloutEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        processor,
        *,
        synced: bool = False,
        micro_batch_size: int = 16,
        copy_dtype: torch.dtype | None = None,
        static_cache: bool = False,
        sleep_level: int = 1,
        device: torch.device | None = None,
    ):
        """``model``: the policy (it generates, unless ``copy_dtype`` asks for an inference copy of that dtype, held on
        ``device``, where the policy computes: by default its parameters' device).
        ``static_cache``: decode with a static KV cache (unsharded only), which ``generate`` compiles on CUDA.
        ``sleep_level``: what :meth:`sleep` does with the copy (``HFEngineConfig.sleep_level``)."""
        self.device = device if device is not None else next(model.parameters()).device
        self.copy = _inference_copy(model, copy_dtype, self.device) if copy_dtype is not None else None
        self.params = dict(self.copy.named_parameters()) if self.copy is not None else {}
        self.sleep_level = sleep_level
        self._dropped: dict[str, torch.Size] = {}  # the copy's weights sleep dropped (sleep_level 2)
        self._unfilled: set[str] = set()  # woken, not yet re-sent by the weight stream
        self._host: _HostCopy | None = None  # where sleep_level 1 keeps the copy's weights on a GPU (made once)
        self.model = self.copy if self.copy is not None else model  # the module that generates
        synced = synced and self.copy is None  # a whole copy on every rank needs no lockstep
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
        self.synced = synced
        self.micro_batch_size = micro_batch_size
        cfg = model.config
        # the generation config's EOS list wins (Qwen instruct models stop at <|im_end|> or <|endoftext|>)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else cfg.get_text_config().eos_token_id
        self.eos_ids = [i for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
        self.pad_id = self.tokenizer.pad_token_id
        self.prefill_once = not synced
        self.static_cache = static_cache and not synced
        self._static = _StaticCaches()  # the static caches decoding reuses (same addresses for a captured graph)
        # a response must never contain vision placeholders (the model would expect image features for them)
        self.suppress = vision_token_ids(self.tokenizer)
        self.merge_area = getattr(getattr(processor, "image_processor", None), "merge_size", 2) ** 2

    @property
    def needs_all_params(self) -> bool:
        """Whether the weight stream must carry frozen parameters too: only when sleep drops the copy's weights (the
        copy keeps frozen ones, a frozen vision tower say, from its load; without a copy no stream is read)."""
        return self.copy is not None and self.sleep_level == 2

    @property
    def weight_dtype(self) -> torch.dtype | None:
        """The inference copy's dtype (the stream is cast to it); None without a copy."""
        return self.copy.dtype if self.copy is not None else None

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the stream into the inference copy (cast to its dtype). Without a copy the engine generates with
        the training module, which already has the weights: the stream is not read, nothing is gathered."""
        if self.copy is None:
            return
        with torch.no_grad():
            for name, tensor in named_params:
                target = self.params.get(name)
                if target is None:
                    raise KeyError(f"hf inference copy: the weight stream names {name!r}, which the copy lacks")
                target.copy_(tensor)
                self._unfilled.discard(name)
        if self._unfilled:  # never generate from memory sleep dropped and nothing wrote
            missing = sorted(self._unfilled)
            raise RuntimeError(
                f"hf inference copy: rollout.hf.sleep_level=2 dropped {len(missing)} weights the weight stream did not "
                f"re-send ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the stream must carry every "
                "parameter (needs_all_params)"
            )

    def sleep(self) -> None:
        """Free the copy's memory while the policy trains (``sleep_level``): 1 moves it to CPU memory (on a GPU),
        2 drops its weights on any device (:meth:`update_weights` writes them all after :meth:`wake`); both drop the
        held static KV caches where they free memory, 0 keeps them with the weights."""
        if self.sleep_level == 2 or (self.sleep_level == 1 and self.device.type != "cpu"):
            self._static.clear()  # its memory too (the weights come back at new addresses: a graph is re-recorded)
        if self.copy is None:
            return
        if self.sleep_level == 2 and not self._dropped:
            for name, p in self.params.items():
                self._dropped[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        elif self.sleep_level == 1 and self.device.type != "cpu" and not self._asleep():
            if self._host is None:
                self._host = _HostCopy(self.params, pin=self.device.type == "cuda")
            self._host.offload(self.params)
        if self.sleep_level and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self.copy is None:
            return
        if self._dropped:  # room for the weights the stream is about to write
            for name, shape in self._dropped.items():
                p = self.params[name]
                p.data = torch.empty(shape, dtype=p.dtype, device=self.device)
            self._unfilled, self._dropped = set(self._dropped), {}
        elif self._asleep():
            self._host.restore(self.params, self.device)

    def _asleep(self) -> bool:
        """Whether the copy's weights are in the host buffer (``sleep_level`` 1 on a GPU, between sleep and wake)."""
        return self._host is not None and self._host.holds(self.params)

    def _inputs(self, batch: dict[str, torch.Tensor], n: int, device, new_tokens: int) -> dict[str, torch.Tensor]:
        rep = {k: v.to(device) for k, v in batch.items()}
        if self.prefill_once and rep["input_ids"].shape[1] > 1:
            return self._prefilled(rep, n, new_tokens)
        out = {
            "input_ids": rep["input_ids"].repeat_interleave(n, 0),
            "attention_mask": rep["attention_mask"].repeat_interleave(n, 0),
        }
        if "mm_token_type_ids" in rep:  # the m-rope positions of image tokens (data_pipelines/collate.py)
            out["mm_token_type_ids"] = rep["mm_token_type_ids"].repeat_interleave(n, 0)
        if "pixel_values" in rep:  # repeat each prompt's patches for its n samples
            grids = _split_grids(
                rep["input_ids"], rep["image_grid_thw"], self.model.config.image_token_id, self.merge_area
            )
            sizes = [int(g.prod(-1).sum()) for g in grids]
            pv = rep["pixel_values"].split(sizes)
            out["pixel_values"] = torch.cat([p for p in pv for _ in range(n)])
            out["image_grid_thw"] = torch.cat([g for g in grids for _ in range(n)])
        return out

    def _prefilled(self, rep: dict[str, torch.Tensor], n: int, new_tokens: int) -> dict[str, torch.Tensor]:
        """``generate`` inputs whose KV cache already holds each prompt but its last token, computed once
        per prompt and expanded to its n samples (prompts are left-padded: the last column is real); with
        ``static_cache`` the cache is copied into a static one with room for ``new_tokens`` more."""
        cut = ("input_ids", "attention_mask", "mm_token_type_ids")
        prefix = {k: (v[:, :-1] if k in cut else v) for k, v in rep.items()}
        if "pixel_values" not in rep:  # the padding-aware text positions generate itself would use
            prefix["position_ids"] = (prefix["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        inner = getattr(self.model, "model", None)
        multimodal_rope = hasattr(inner, "rope_deltas")
        if multimodal_rope:
            inner.rope_deltas = None  # set by this prefill (image prompts) or zero (text positions above)
        # logits_to_keep=1: only the cache is kept, so the LM head runs on one position instead of every prompt token
        # decoding attends over one shared prompt cache where the text attention is packed_sdpa (SDPA models)
        # (and a static cache's decode steps attend on the KV heads without copying the cache per query head)
        shared = use_packed_attention(self.model) and not self.static_cache
        cache = getattr(self.model(**prefix, use_cache=True, logits_to_keep=1), CACHE)
        if shared:  # each prompt's cache held once for its n samples, theirs filled in place (no copy per step)
            cache = share_prompt_cache(cache, prefix["attention_mask"], n, new_tokens + 1)
        else:
            cache.batch_repeat_interleave(n)
        if self.static_cache:
            cache = self._static.filled(cache, self.model.config, rep["input_ids"].shape[1] + new_tokens)
        if multimodal_rope:  # generate continues at text position + each prompt's m-rope offset
            deltas = inner.rope_deltas
            if deltas is None:
                deltas = torch.zeros((rep["input_ids"].shape[0], 1), dtype=torch.long, device=rep["input_ids"].device)
            inner.rope_deltas = deltas.repeat_interleave(n, 0)
        return {
            "input_ids": rep["input_ids"].repeat_interleave(n, 0),
            "attention_mask": rep["attention_mask"].repeat_interleave(n, 0),
            CACHE: cache,
        }

    @torch.no_grad()
    def generate(self, prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        model = self.model
        was_training = model.training
        model.eval()
        if self.copy is not None:
            self.wake()  # a no-op when awake
            if self._unfilled:  # sleep_level 2 dropped them and no update_weights has written them since
                raise RuntimeError(
                    f"hf inference copy: generate after rollout.hf.sleep_level=2 dropped {len(self._unfilled)} "
                    "weights and before update_weights re-sent them; call update_weights after wake"
                )
        device = next(model.parameters()).device
        rollouts: list[Rollout] = []
        try:
            for start in range(0, len(prompts), self.micro_batch_size):
                chunk = prompts[start : start + self.micro_batch_size]
                batch = collate_prompts(chunk, self.pad_id)
                width = batch["input_ids"].shape[1]
                kwargs = dict(
                    max_new_tokens=sampling.max_new_tokens,
                    eos_token_id=self.eos_ids,
                    pad_token_id=self.pad_id,
                    synced_gpus=self.synced,
                    use_cache=True,
                    suppress_tokens=self.suppress or None,
                )
                if sampling.temperature > 0:
                    kwargs.update(
                        do_sample=True,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=sampling.top_k or None,
                    )
                else:
                    kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
                if sampling.stop:
                    kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
                with _root_unsharded(model):  # the prefill and generate share the root's gathered parameters
                    inputs = self._inputs(batch, sampling.n, device, sampling.max_new_tokens)
                    out = model.generate(**inputs, **kwargs)
                new = out[:, width:].cpu()
                for row in range(new.shape[0]):
                    rollouts.append(self._finish(start + row // sampling.n, new[row], sampling))
        finally:
            model.train(was_training)
        return rollouts

    def _finish(self, prompt_index: int, tokens: torch.Tensor, sampling: SamplingParams) -> Rollout:
        ids = tokens.tolist()
        reason = "length"
        for pos, tok in enumerate(ids):
            if tok in self.eos_ids:
                ids, reason = ids[: pos + 1], "stop"
                break
        else:  # generate pads a row only once it stopped: without EOS, at a stop string
            kept = len(ids)
            while kept and ids[kept - 1] == self.pad_id:
                kept -= 1
            if kept < len(ids) and sampling.stop and _ends_at_stop(self._text(ids[:kept]), sampling.stop):
                ids = ids[:kept]
            # else a pad token the policy sampled is a response token: it is trained on like any other (dropped,
            # its probability would grow unchecked, and a response of nothing but it would be empty)
        text = self._text(ids)
        if reason == "length" and _ends_at_stop(text, sampling.stop):
            reason = "stop"
        return Rollout(prompt_index, torch.tensor(ids, dtype=torch.long), text, reason)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _ends_at_stop(text: str, stop: list[str]) -> bool:
    """Whether ``text`` ends with one of the stop strings (an empty text ends with none)."""
    return bool(text) and any(text.endswith(s) for s in stop)


# static caches are allocated in lengths of this many tokens, so that prompts of similar width share one
# compiled decode step (a new cache length means a new graph)
STATIC_CACHE_BUCKET = 256


class _StaticCaches:
    """The engine's static KV caches, reused from one rollout to the next: the ``KEEP`` most recently used, one per
    shape (rows, length rounded up to :data:`STATIC_CACHE_BUCKET`, dtype, device). A decode step captured as a CUDA
    graph reads its cache at the addresses it was recorded with; a new cache per rollout would have the graph
    recorded again at every rollout (cudagraph trees re-record when a static input's address changes; torch 2.5
    began counting such re-records toward a limit of 128 a function, past which it runs without graphs, and 2.13
    no longer counts them: releases in between not checked). :meth:`HFRolloutEngine.sleep` drops them where it
    frees memory (the weights then move anyway); with ``sleep_level=0`` (or no copy) they stay, like the weights."""

    KEEP = 2  # shapes held at once: a few prompt widths alternate without new caches; each holds rows x length K/V

    def __init__(self):
        self._held: dict[tuple, StaticCache] = {}  # least recently used first

    def filled(self, cache, config, length: int) -> StaticCache:
        """A static cache of ``length`` tokens (rounded up) holding exactly what the dynamic ``cache`` holds and
        zeros after it: a held one of the same shape, reset, or a new one."""
        size = -(-length // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
        first = cache.layers[0].keys
        key = (first.shape[0], size, first.dtype, first.device)
        static = self._held.pop(key, None)
        if static is None:
            static = StaticCache(config=config, max_cache_len=size)
        else:
            static.reset()  # zeros in place: the same tensors, so the same addresses
        self._held[key] = static
        while len(self._held) > self.KEEP:
            self._held.pop(next(iter(self._held)))
        for i, layer in enumerate(cache.layers):
            # cache_position: the releases whose static layers write where they are told (the CUDA image's 5.17)
            position = torch.arange(layer.keys.shape[-2], device=layer.keys.device)
            static.update(layer.keys, layer.values, i, {"cache_position": position})
        return static

    def clear(self) -> None:
        self._held.clear()


class _HostCopy:
    """The inference copy's weights in CPU memory while it sleeps (``sleep_level`` 1 on a GPU): buffers made at the
    first sleep and reused at every later one, page-locked on CUDA (``pin``), so each sleep and wake is one DMA
    transfer per weight instead of ``Module.to``'s copies through fresh pageable memory (measured 1.6-1.9 GB/s,
    about 4 s a step at 3B on an H200) and no host allocation after the first step.

    torch's page-locked allocator rounds every allocation up to a power of two, so one buffer for a whole copy could
    take up to twice its size (a 9 GiB copy 16 GiB); the weights are packed into buffers of ``CHUNK`` bytes (one
    of the next power of two for a weight larger than that) instead, which waste at most the tail each leaves
    (:func:`_host_layout`). Each weight's view starts at a multiple of ``ALIGN`` bytes (any dtype's alignment)."""

    ALIGN = 64
    CHUNK = 1 << 30

    def __init__(self, params: dict[str, torch.Tensor], pin: bool):
        sizes = [p.numel() * p.element_size() for p in params.values()]
        places, used = _host_layout(sizes, self.CHUNK, self.ALIGN)
        self.buffers = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in used]
        self.views = {
            name: self.buffers[b][o : o + n].view(p.dtype).view(p.shape)
            for (name, p), n, (b, o) in zip(params.items(), sizes, places)
        }

    def holds(self, params: dict[str, torch.Tensor]) -> bool:
        """Whether the weights live in these buffers (asleep)."""
        return all(p.data_ptr() == self.views[name].data_ptr() for name, p in params.items())

    def offload(self, params: dict[str, torch.Tensor]) -> None:
        """Copy every weight into the buffers and point the parameter at its view: its device memory is free once
        the caller empties the cache."""
        for name, p in params.items():
            self.views[name].copy_(p.data, non_blocking=True)
        if self.buffers and self.buffers[0].is_pinned():
            torch.cuda.current_stream().synchronize()  # the transfers are done before the device memory is reused
        for name, p in params.items():
            p.data = self.views[name]

    def restore(self, params: dict[str, torch.Tensor], device: torch.device) -> None:
        """Back on ``device``, in new memory (the next :meth:`offload` writes the buffers after these transfers on
        the same stream)."""
        for name, p in params.items():
            p.data = torch.empty_like(p.data, device=device).copy_(self.views[name], non_blocking=True)


def _host_layout(sizes: list[int], chunk: int, align: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Pack weights of ``sizes`` bytes, in order, into buffers: returns each weight's (buffer, byte offset) and each
    buffer's used bytes. A buffer holds ``chunk`` bytes (a power of two), or the next power of two of a weight larger
    than that; a weight that does not fit in the rest of the current buffer starts a new one; offsets are multiples
    of ``align``."""
    places: list[tuple[int, int]] = []
    used: list[int] = []
    capacity = 0
    for n in sizes:
        size = -(-n // align) * align
        if not used or used[-1] + size > capacity:
            capacity = max(chunk, 1 << max(size - 1, 0).bit_length())
            used.append(0)
        places.append((len(used) - 1, used[-1]))
        used[-1] += size
    return places, used


def _inference_copy(policy: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A plain model of the policy's folder (``name_or_path``) in ``dtype`` on ``device``, in eval mode, without
    gradients.
    Its weights are the folder's until the first :meth:`HFRolloutEngine.update_weights`."""
    folder = getattr(policy, "name_or_path", "") or ""
    if not folder or not Path(folder).is_dir():
        raise ConfigError(
            f"rollout.hf.inference_copy: the policy has no model folder to load the copy from (name_or_path="
            f"{folder!r}); set rollout.hf.inference_copy=off"
        )
    copy, _ = load_model(folder, dtype, device, processor=False)
    if uses_onednn(policy):  # computes as the policy does
        use_onednn_linears(copy)
    return copy.eval().requires_grad_(False)


@contextmanager
def _root_unsharded(model: torch.nn.Module):
    """FSDP2: keep the root's own parameters (embeddings, patch embedding, merger, norm, lm_head)
    gathered during ``generate`` and the embed-once inputs, which call the embeddings and the vision
    tower's ``get_image_features`` directly, outside the root forward whose hooks would gather them
    (FSDP2 on one GPU embeds once: it does not shard, so it does not generate in lockstep). Nested
    blocks keep their own hooks."""
    if not (hasattr(model, "unshard") and hasattr(model, "reshard")):
        yield
        return
    # the root must initialise its FSDP state before any nested block runs on its own (else that block
    # would become a root); a root forward does this, generate's direct vision call does not
    model._get_fsdp_state()._lazy_init()
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def _split_grids(
    input_ids: torch.Tensor, grid: torch.Tensor, image_token_id: int, merge_area: int
) -> list[torch.Tensor]:
    """``image_grid_thw`` rows belonging to each prompt of a batch (prompts may have 0..k images)."""
    per_image_tokens = (grid.prod(-1) // merge_area).tolist()
    counts = (input_ids == image_token_id).sum(-1).tolist()
    out, i = [], 0
    for c in counts:
        k, total = 0, 0
        while total < c:
            total += per_image_tokens[i + k]
            k += 1
        out.append(grid[i : i + k])
        i += k
    return out
