"""The ``hf`` rollout engine on a module: batched ``generate`` on the policy module itself, and the generate loop
its inference copy (``vlrft.rollout.inference_copy``) shares.

Images of a prompt are preprocessed once (the :class:`EncodedPrompt`) and, on an unsharded model
(``prefill_once``), each prompt's prefill runs once: one forward over the left-padded prompts (the vision
tower once per unique prompt, all but the last prompt token) fills a KV cache, which becomes the cache of the
n samples (with Qwen-VL's m-rope offsets) without being copied n times (``prefix_decoding.SharedPrefixLayer``:
the prompt's keys once, read once per prompt at each decode step, the samples' own keys filled in place), and
``generate`` continues from it, so the prompt and its images are computed and held once per group instead of n
times. With ``static_cache`` the prefill is copied into a static cache instead (``vlrft.rollout.static_cache``:
the compiled decode of ``rollout.hf.compile``).
Sharded models (FSDP2, ZeRO-3) generate through the root module in lockstep (``synced_gpus``) on the
prompts repeated n times instead.

FIRE sampling (``SamplingParams.first_token_temperature``), keyed sampling (``SamplingParams.keys``), the drawn
tokens' log-probs and partial rollouts' weight loads (:attr:`HFRolloutEngine.between_steps`) are one logits processor
(:class:`DrawnDistribution`), the same on every path: the module or its copy, prefill once or not, a static cache or
not, lockstep or not (but partial rollouts).

Which of these an engine does (a copy or the module, a static cache or not, lockstep or not) is decided in one
place, the engine's builder (``vlrft.rollout.hf``), from ``rollout.hf`` and where the policy computes.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager, nullcontext
from typing import Callable, Iterable

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

from data_pipelines.collate import MODALITIES, EncodedPrompt, collate_prompts, tokenizer_of
from vlrft.models.attention_functions import use_packed_attention
from vlrft.models.moe import is_moe
from vlrft.models.prefix_decoding import CACHE, repeat_cache, share_prompt_cache
from vlrft.models.routing_replay import record_routing, sequence_routing
from vlrft.rollout.base import Rollout, SamplingParams, vision_token_ids
from vlrft.rollout.keyed import gumbel_max, row_keys
from vlrft.rollout.static_cache import StaticCaches


class HFRolloutEngine:
    """Generates with the module it is given (no weights of its own: :meth:`update_weights` reads nothing)."""

    copy: torch.nn.Module | None = None  # the inference copy that generates instead (InferenceCopyEngine)
    owns_weights = False  # it generates with the module it was given: building one costs nothing
    needs_all_params = False  # no weight stream is read
    weight_dtype: torch.dtype | None = None  # the dtype the stream is cast to: none read
    # Partial rollouts (``rollout.asynchronous.partial``, vlrft.trainer.async_rl): called before each micro-batch's
    # prefill and at every decode step, after the step's forward and before its token is drawn; it may load newer
    # weights, in place, into the module that generates, and returns the version of the weights the next forward
    # computes with. Each token records the version whose forward gave its scores (``Rollout.versions``); the KV cache
    # of the tokens before stays as the older weights computed it, so the log-prob reported for a token is that of the
    # distribution it was actually drawn from (the newer weights reading the older cache): the behaviour policy of the
    # decoupled objective is exactly the mixed one that sampled. None: no hook, no versions (unsharded engines only).
    between_steps: Callable[[], int] | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        processor,
        *,
        synced: bool = False,
        micro_batch_size: int = 16,
        static_cache: bool = False,
        sleep_level: int = 1,
        device: torch.device | None = None,
        routing_replay: bool = False,
    ):
        """``model``: the policy, which generates (its generation config names the EOS tokens); ``device``: where
        the policy computes (by default its parameters' device). ``synced``: its parameters are sharded over the
        ranks, which then generate in lockstep. ``static_cache``: decode with a static KV cache (unsharded only),
        which ``generate`` compiles on CUDA. ``sleep_level``: whether :meth:`sleep` frees the held static caches
        (``HFEngineConfig.sleep_level``). ``routing_replay``: each rollout carries the experts every MoE layer routed
        its prompt and response tokens to (``Rollout.routing``, ``vlrft.models.routing_replay``)."""
        if routing_replay and static_cache:
            raise ValueError("hf engine: routing replay records the experts in eager decode only (static_cache=False)")
        if routing_replay and not is_moe(model):
            raise ValueError(f"hf engine: routing replay on {type(model).__name__}, which has no experts")
        self.routing_replay = routing_replay
        if synced and static_cache:
            raise ValueError("hf engine: a static cache decodes an unsharded model only (synced=False)")
        self.device = device if device is not None else next(model.parameters()).device
        self.sleep_level = sleep_level
        self.model = model  # the module that generates
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
        self.static_cache = static_cache
        self._static = StaticCaches()  # the static caches decoding reuses (same addresses for a captured graph)
        # a response must never contain vision placeholders (the model would expect image features for them)
        self.suppress = vision_token_ids(self.tokenizer)
        self.merge_area = getattr(getattr(processor, "image_processor", None), "merge_size", 2) ** 2

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: the training module the engine generates with already has the weights (the stream is
        not read, nothing is gathered)."""

    def sleep(self) -> None:
        """Drop the held static KV caches where sleeping frees memory; the module's weights stay."""
        self._release_static_caches()

    def _release_static_caches(self) -> None:
        """Drop the held static KV caches where sleeping frees memory (``sleep_level`` 2, or 1 on a GPU); 0 keeps
        them with the weights."""
        if self.sleep_level == 2 or (self.sleep_level == 1 and self.device.type != "cpu"):
            self._static.clear()  # its memory too (the weights come back at new addresses: a graph is re-recorded)

    def wake(self) -> None:
        """Nothing to bring back: the module's weights never left."""

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
        for m in MODALITIES:  # repeat each prompt's patches (images, videos) for its n samples
            if m.pixels not in rep:
                continue
            token_id = self.tokenizer.convert_tokens_to_ids(m.token)
            counts = _items_per_prompt(rep["input_ids"], rep[m.grid], token_id, self.merge_area)
            for key, rows in ((m.pixels, rep[m.grid].prod(-1)), (m.grid, None), *((k, None) for k in m.per_item)):
                if key in rep:
                    out[key] = _repeat_items(rep[key], counts, n, rows)
        return out

    def _prefilled(self, rep: dict[str, torch.Tensor], n: int, new_tokens: int) -> dict[str, torch.Tensor]:
        """``generate`` inputs whose KV cache already holds each prompt but its last token, computed once
        per prompt and expanded to its n samples (prompts are left-padded: the last column is real); with
        ``static_cache`` the cache is copied into a static one with room for ``new_tokens`` more."""
        cut = ("input_ids", "attention_mask", "mm_token_type_ids")
        prefix = {k: (v[:, :-1] if k in cut else v) for k, v in rep.items()}
        if not any(m.pixels in rep for m in MODALITIES):  # the padding-aware text positions generate itself would use
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
            cache = repeat_cache(cache, n)  # linear-attention layers' states too (Qwen3.5)
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
        device = next(model.parameters()).device
        rollouts: list[Rollout] = []
        sampling.check_keys(len(prompts))
        hook = self.between_steps
        if hook is not None and self.synced:
            raise ValueError("hf engine: between_steps (partial rollouts) needs an unsharded engine (synced=False)")
        try:
            for start in range(0, len(prompts), self.micro_batch_size):
                chunk = prompts[start : start + self.micro_batch_size]
                version = hook() if hook is not None else 0  # a newer version lands before the prefill too
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
                drawn = None  # the drawn tokens' log-probs, where FIRE samples or they are asked for
                keyed = sampling.keys is not None and sampling.temperature > 0
                if sampling.first_token_temperature is not None or sampling.logprobs or keyed or hook is not None:
                    # rows are prompt-major, n per prompt, on every path (_inputs): row r is prompt r // n
                    keys = row_keys(sampling.keys[start : start + len(chunk)], sampling.n, device) if keyed else None
                    drawn = DrawnDistribution(width, sampling, keys, between_steps=hook, version=version)
                    # it tempers and filters the scores itself: generate adds no warper after it; keyed, it draws
                    # the token itself and leaves generate one to pick (greedily: no global RNG is read)
                    kwargs.update(
                        do_sample=sampling.temperature > 0 and not keyed,
                        temperature=None if keyed else 1.0,
                        top_p=None,
                        top_k=None,
                        logits_processor=LogitsProcessorList([drawn]),
                    )
                elif sampling.temperature > 0:
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
                recording = record_routing(model) if self.routing_replay else nullcontext(None)
                with _root_unsharded(model), recording as record:  # prefill and generate share the gathered root
                    inputs = self._inputs(batch, sampling.n, device, sampling.max_new_tokens)
                    out = model.generate(**inputs, **kwargs)
                new = out[:, width:].cpu()
                logps = drawn.logprobs(out) if drawn is not None and sampling.logprobs else None
                versions = drawn.versions(out) if hook is not None else None  # [steps], the same for every row
                made = [
                    self._finish(
                        start + row // sampling.n,
                        new[row],
                        sampling,
                        logps[row] if logps is not None else None,
                        versions,
                    )
                    for row in range(new.shape[0])
                ]
                if record is not None:  # [rows, width + steps, L, k] -> each sample's [prompt | response] positions
                    lengths = [chunk[x.prompt_index - start].input_ids.numel() for x in made]
                    routed = sequence_routing(record.take(), width, lengths, [x.response_ids.numel() for x in made])
                    for x, experts in zip(made, routed, strict=True):
                        x.routing = experts
                rollouts.extend(made)
        finally:
            model.train(was_training)
        return rollouts

    def _finish(
        self,
        prompt_index: int,
        tokens: torch.Tensor,
        sampling: SamplingParams,
        logprobs: torch.Tensor | None,
        versions: torch.Tensor | None = None,
    ) -> Rollout:
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
        lp = logprobs[: len(ids)] if logprobs is not None else None
        vs = versions[: len(ids)].clone() if versions is not None else None
        return Rollout(prompt_index, torch.tensor(ids, dtype=torch.long), text, reason, lp, versions=vs)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class DrawnDistribution(LogitsProcessor):
    """The distribution ``generate`` draws each response token from, step by step, where it is not one temperature
    for every token (FIRE: ``SamplingParams.first_token_temperature``) or where the drawn tokens' log-probs are
    wanted (``SamplingParams.logprobs``): the scores of the first response step divided by the first token's
    temperature, those of later steps by ``temperature``, then top-k and top-p (transformers' own warpers, in
    ``generate``'s order: temperature first), and the log-softmax of the result, from which the next step reads the
    log-prob of the token drawn (generate appends it to ``input_ids``) and :meth:`logprobs` the last one's.
    ``generate`` is then given temperature 1 and no top-k / top-p, so that it adds no warper after this one (it places
    a caller's processors after its own, which suppress the vision tokens, and before its warpers). Greedy
    (``temperature == 0``): the argmax of the raw scores, its log-probs at temperature 1 (the trainer's for greedy).

    Keyed (``keys``: the rows' keys, ``vlrft.rollout.keyed.row_keys``): it draws each row's token itself from those
    log-probs by Gumbel-max with the row's keyed noise at the decode position (response tokens so far), and returns
    scores that are -inf but on that token, which ``generate`` (greedy) then picks.

    Partial rollouts (``between_steps``, :attr:`HFRolloutEngine.between_steps`): at every step it records the version
    of the weights whose forward gave the scores, then calls the hook, which may load newer weights for the next
    forward; :meth:`versions` returns the steps' versions. Keyed, each token stays a function of its key and the
    weights that computed it; which version that is depends on when the trainers' update lands."""

    def __init__(
        self,
        width: int,
        sampling: SamplingParams,
        keys: torch.Tensor | None = None,
        *,
        between_steps: Callable[[], int] | None = None,
        version: int = 0,
    ):
        """``width``: the prompts' (left-padded) width, where the response starts in ``input_ids``; ``keys``: ``[B]``
        int64 row keys (keyed sampling, ``temperature > 0`` only), None: ``generate`` draws. ``between_steps``: the
        engine's hook, ``version``: the version of the weights that computed the prefill (and the first scores)."""
        if keys is not None and sampling.temperature == 0:
            raise ValueError("keyed sampling draws at temperature > 0 only (greedy needs no keys)")
        self.keys = keys
        self.between_steps, self.version = between_steps, version
        self._versions: list[int] = []  # per step: the version whose forward computed its scores
        rest = sampling.temperature if sampling.temperature > 0 else 1.0
        self.width, self.rest = width, rest
        self.first = sampling.first_token_temperature or rest
        greedy = sampling.temperature == 0
        self.warpers = [] if greedy else [TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []
        if not greedy and sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self._last: torch.Tensor | None = None  # [B, V] the last step's log-probs
        self._drawn: list[torch.Tensor] = []  # [B] per step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.between_steps is not None:  # between this step's forward and the next: a newer version may land
            self._versions.append(self.version)
            self.version = self.between_steps()
        if self._last is not None:  # the token drawn at the previous step ends input_ids now
            self._drawn.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        scores = scores / (self.first if input_ids.shape[1] == self.width else self.rest)
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        self._last = torch.log_softmax(scores.float(), dim=-1)
        if self.keys is None:
            return scores
        if self.keys.shape[0] != scores.shape[0]:
            raise RuntimeError(f"hf engine: {self.keys.shape[0]} sampling keys for {scores.shape[0]} rows")
        token = gumbel_max(self._last, self.keys.to(scores.device), input_ids.shape[1] - self.width)
        return torch.full_like(scores, -torch.inf).scatter_(-1, token[:, None], 0.0)

    def logprobs(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[B, steps]`` float32 log-probs of the tokens drawn into ``sequences`` (``generate``'s output), on the CPU;
        rows that stopped early carry pads' values past their end (their responses are cut there)."""
        drawn = list(self._drawn)
        if self._last is not None:
            drawn.append(self._last.gather(-1, sequences[:, -1:]).squeeze(-1))
        if len(drawn) != sequences.shape[1] - self.width:
            raise RuntimeError(f"hf engine: {len(drawn)} sampling steps for {sequences.shape[1] - self.width} tokens")
        return torch.stack(drawn, dim=-1).float().cpu() if drawn else torch.zeros((sequences.shape[0], 0))

    def versions(self, sequences: torch.Tensor) -> torch.Tensor:
        """``[steps]`` int64: the version that computed each step's scores (every row's token of that step), where a
        ``between_steps`` hook was given."""
        if len(self._versions) != sequences.shape[1] - self.width:
            raise RuntimeError(
                f"hf engine: {len(self._versions)} versioned steps for {sequences.shape[1] - self.width} tokens"
            )
        return torch.tensor(self._versions, dtype=torch.int64)


def _ends_at_stop(text: str, stop: list[str]) -> bool:
    """Whether ``text`` ends with one of the stop strings (an empty text ends with none)."""
    return bool(text) and any(text.endswith(s) for s in stop)


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


def _items_per_prompt(input_ids: torch.Tensor, grid: torch.Tensor, token_id: int, merge_area: int) -> list[int]:
    """How many of the ``grid`` rows (images or videos, in prompt order) each prompt of a batch holds, read off its
    placeholder tokens (prompts may have 0..k items)."""
    per_item_tokens = (grid.prod(-1) // merge_area).tolist()
    out, i = [], 0
    for c in (input_ids == token_id).sum(-1).tolist():
        k, total = 0, 0
        while total < c:
            total += per_item_tokens[i + k]
            k += 1
        out.append(k)
        i += k
    return out


def _repeat_items(values: torch.Tensor, counts: list[int], n: int, rows: torch.Tensor | None) -> torch.Tensor:
    """Each prompt's items of ``values`` (``counts`` per prompt) repeated for its ``n`` samples; ``rows``: the
    rows of ``values`` each item has (pixel rows: its patches), else one."""
    sizes = rows.tolist() if rows is not None else [1] * int(sum(counts))
    per_prompt = [sum(sizes[a:b]) for a, b in itertools.pairwise([0, *itertools.accumulate(counts)])]
    return torch.cat([p for p in values.split(per_prompt) for _ in range(n)])
