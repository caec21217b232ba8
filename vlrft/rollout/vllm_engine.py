"""The ``vllm`` rollout engine: a colocated vLLM ``LLM`` in the trainer's own process (``rollout.engine=vllm``).

Created once per process from the policy's folder; after each optimizer step the trainer streams the
new weights into it (``update_weights``: Hugging Face names, one tensor at a time, through vLLM's
``reload_weights`` worker call), then the prefix cache (and, for Qwen-VL, the encoder cache) is reset
so nothing computed with the old weights is reused. Prompts go in as token ids with the raw (already
resized) images in ``multi_modal_data``: each run of image placeholders is collapsed to one, which vLLM
expands again. ``n`` samples per prompt are one request. The sampled tokens' log-probs come back after
temperature, top-k and top-p (``logprobs_mode="processed_logprobs"``), for rollout correction. FIRE sampling
(``SamplingParams.first_token_temperature``: vLLM has one temperature per request) is two requests, the first token
hot, then the rest from the prompt and that token (:meth:`VLLMRolloutEngine._fire`). Keyed sampling
(``SamplingParams.keys``) is vLLM's per-request seed, the prompt's key (untested here: vLLM is absent where the tests
run).

Sleep/wake: on GPUs the engine is created with ``enable_sleep_mode`` and frees its weights and KV cache
(``rollout.vllm.sleep_level``) while the policy trains; vLLM's CPU backend refuses sleep mode, so there
``sleep``/``wake`` are no-ops (said once in the log). On CPU: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
eager, one process per engine (tensor parallel is refused). ``scripts/setup.sh --vllm`` builds the venv.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from data_pipelines.collate import EncodedPrompt, tokenizer_of
from vlrft.config import ConfigError, option
from vlrft.models.processing import IMAGE_ONLY_PROCESSORS, torchvision_available
from vlrft.rollout.base import Rollout, SamplingParams, subkey, vision_token_ids
from vlrft.rollout.registry import register_engine

log = logging.getLogger(__name__)

# a response must never contain these (the next forward would expect image features for them)
IMAGE_PAD = "<|image_pad|>"
SEED_MASK = (1 << 62) - 1  # a keyed request's seed: its key's low 62 bits, so that vLLM's seed + sample index fits


@dataclass
class VLLMConfig:
    """The colocated vLLM engine (``rollout.engine=vllm``)."""

    gpu_memory_utilization: float = option(
        0.4, "share of GPU memory vLLM may take (weights + KV cache), the rest is the trainer's"
    )
    kv_cache_gib: float = option(
        0.0, "KV cache size in GiB (0: what gpu_memory_utilization leaves on a GPU; 1 GiB on CPU)"
    )
    max_model_len: int = option(0, "longest prompt + response in tokens (0: the model's own limit)")
    sleep_level: int = option(
        1,
        "while the policy trains: 0 keep everything, 1 offload weights to CPU and drop the KV cache, 2 drop "
        "both (every parameter is then re-sent after each step); a no-op on CPU",
        choices=(0, 1, 2),
    )
    enforce_eager: bool = option(False, "no CUDA graphs (always on for CPU)")
    dtype: str = option(
        "auto", "vLLM's dtype (auto: the policy's; float32 on CPU)", choices=("auto", "float32", "bfloat16")
    )
    tensor_parallel_size: int = option(1, "GPUs per engine (vLLM tensor parallel; 1 on CPU)")
    max_images_per_prompt: int = option(8, "vLLM's limit_mm_per_prompt for images")


def collapse_image_pads(ids: list[int], image_pad_id: int) -> list[int]:
    """Prompt token ids with each run of image placeholders collapsed to one (vLLM expands it itself)."""
    out: list[int] = []
    for tok in ids:
        if tok == image_pad_id and out and out[-1] == image_pad_id:
            continue
        out.append(tok)
    return out


def _vllm_module():
    # vLLM is an optional heavy dependency (its own venv: scripts/setup.sh --vllm): imported here only
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(
            f"rollout.engine=vllm: vLLM does not import ({exc}); build its venv with "
            "`bash scripts/setup.sh --vllm` and run with .venv-vllm/bin/python"
        ) from exc
    return vllm


class VLLMRolloutEngine:
    """A vLLM engine on the policy in ``model_path`` (a folder vLLM loads: config, weights, processor)."""

    owns_weights = True  # loaded by vLLM from the folder, then written by the weight stream

    def __init__(
        self,
        model_path: str,
        processor,
        cfg: VLLMConfig | None = None,
        *,
        model_dtype: torch.dtype = torch.float32,
        distributed: bool = False,
        seed: int = 0,
    ):
        cfg = cfg or VLLMConfig()
        self.cfg = cfg
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            if cfg.tensor_parallel_size != 1:
                raise ConfigError(
                    f"rollout.vllm.tensor_parallel_size={cfg.tensor_parallel_size}: vLLM's CPU backend runs "
                    "one engine per process here; set it to 1"
                )
            # in-process engine: the weight stream (tensors, an iterator) cannot cross to a worker process
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            # vLLM cuts a serving process to one torch thread unless OMP_NUM_THREADS is set, and its CPU worker
            # then makes torch.set_num_threads a no-op: here that process is the trainer's (update, old/ref
            # log-probs). Keep the trainer's thread count, and give torch its own setter back below.
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        vllm = _vllm_module()
        self._vllm = vllm
        if not torchvision_available():
            _image_only_processors()
        vocab = self.tokenizer.get_vocab()
        self.image_pad_id = vocab.get(IMAGE_PAD)
        self.suppress = set(vision_token_ids(self.tokenizer))
        self.sleep_mode = on_gpu and cfg.sleep_level > 0
        self.asleep = False
        self._said_no_sleep = False
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "float32" if not on_gpu else str(model_dtype).removeprefix("torch.")
        self.weight_dtype = getattr(torch, dtype)  # what vLLM holds its weights and computes in
        kwargs = dict(
            model=str(model_path),
            tokenizer=str(model_path),
            dtype=dtype,
            seed=seed,
            enforce_eager=cfg.enforce_eager or not on_gpu,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_sleep_mode=self.sleep_mode,
        )
        if on_gpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        # on CPU vLLM would reserve gpu_memory_utilization x all host memory; a fixed KV cache instead
        kv_gib = cfg.kv_cache_gib or (0.0 if on_gpu else 1.0)
        if kv_gib:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        if cfg.max_model_len:
            kwargs["max_model_len"] = cfg.max_model_len
        if getattr(processor, "image_processor", None) is not None:
            kwargs["limit_mm_per_prompt"] = {"image": cfg.max_images_per_prompt, "video": 0}
        if distributed:  # the engine lives in each torchrun rank (TRL's and EasyR1's colocation)
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.llm = vllm.LLM(**kwargs)
        if not on_gpu:
            torch.set_num_threads = set_num_threads
            if torch.get_num_threads() != threads:
                set_num_threads(threads)
        model_config = self.llm.model_config
        hf_config = model_config.hf_config
        text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        # the generation config's EOS list wins, as in the hf engine (Qwen instruct: <|im_end|>, <|endoftext|>)
        eos = model_config.try_get_generation_config().get("eos_token_id")
        eos = eos if eos is not None else text_cfg.eos_token_id
        self.eos_ids = [i for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
        self.vocab_size = int(text_cfg.vocab_size)
        self.allowed = [i for i in range(self.vocab_size) if i not in self.suppress]

    # ------------------------------------------------------------------ seam
    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream (HF name, tensor) pairs into the engine, then forget caches built with the old weights."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": _cpu_stream(named_params)})
        self.llm.reset_prefix_cache()
        reset_mm = getattr(self.llm, "reset_mm_cache", None)
        if reset_mm is not None:
            reset_mm()
        reset_encoder = getattr(self.llm.llm_engine, "reset_encoder_cache", None)
        if reset_encoder is not None:
            reset_encoder()

    def sleep(self) -> None:
        if not self.sleep_mode:
            self._no_sleep()
            return
        if not self.asleep:
            self.llm.sleep(level=self.cfg.sleep_level)
            self.asleep = True

    def wake(self) -> None:
        if not self.sleep_mode:
            self._no_sleep()
            return
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    @property
    def needs_all_params(self) -> bool:
        """Level-2 sleep drops the weights: every tensor (a frozen tower too) must be re-sent."""
        return self.sleep_mode and self.cfg.sleep_level == 2

    def _no_sleep(self) -> None:
        if not self._said_no_sleep:
            log.warning("vLLM engine: sleep mode is unavailable here (CPU backend); sleep/wake are no-ops")
            self._said_no_sleep = True

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        if self.asleep:
            self.wake()
        sampling.check_keys(len(prompts))
        requests = [self._request(p) for p in prompts]
        if sampling.first_token_temperature is not None:
            return self._fire(requests, sampling)
        outputs = self.llm.generate(requests, self._per_request(sampling, sampling.keys), use_tqdm=False)
        return [self._rollout(index, sample) for index, out in enumerate(outputs) for sample in out.outputs]

    def _per_request(self, sampling: SamplingParams, keys: list[int] | None):
        """vLLM's sampling parameters: one for every request, or with ``keys`` one per request seeded by its key
        (vLLM draws a seeded request from a generator of its own, and sample ``j`` of ``n`` at seed + j): keyed
        sampling as vLLM does it, which is not the hf engine's noise (``vlrft.rollout.keyed``), so the two engines
        draw different tokens for one key."""
        if keys is None or sampling.temperature == 0:
            return self._params(sampling)
        return [self._params(sampling, seed=key & SEED_MASK) for key in keys]

    def _params(self, sampling: SamplingParams, seed: int | None = None):
        return self._vllm.SamplingParams(
            seed=seed,
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off in both
            max_tokens=sampling.max_new_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=self.eos_ids,
            include_stop_str_in_output=True,  # the hf engine keeps stop strings in the response
            skip_special_tokens=True,
            logprobs=0,
            allowed_token_ids=self.allowed if self.suppress else None,
        )

    def _fire(self, requests: list[dict], sampling: SamplingParams) -> list[Rollout]:
        """FIRE in two requests, as vLLM has one temperature per request: the first token of each of the n samples at
        ``first_token_temperature`` (one request per prompt, max_tokens 1), then each sample that did not end there
        continued from its prompt and that token at ``temperature`` (one request each, n=1). The prefix cache holds
        the prompt's blocks from the first request, so the second prefills little more than the new token. Each
        token's log-prob is vLLM's at the temperature it was drawn at."""
        keys = sampling.keys
        hot = self.llm.generate(requests, self._per_request(sampling.first_token_only(), keys), use_tqdm=False)
        firsts = [self._rollout(index, sample) for index, out in enumerate(hot) for sample in out.outputs]
        rest = dataclasses.replace(sampling.after_first_token(), n=1, max_new_tokens=sampling.max_new_tokens - 1)
        going = [k for k, x in enumerate(firsts) if x.finish_reason == "length" and rest.max_new_tokens > 0]
        more = [
            {**requests[firsts[k].prompt_index], "prompt_token_ids": self._continued(requests, firsts[k])}
            for k in going
        ]
        if keys is not None:  # sample k is sample k % n of its prompt: its continuation keyed apart from the hot draw
            keys = [subkey(keys[firsts[k].prompt_index], "fire-rest", k % sampling.n) for k in going]
        outputs = self.llm.generate(more, self._per_request(rest, keys), use_tqdm=False) if more else []
        for k, out in zip(going, outputs):
            firsts[k] = self._joined(firsts[k], self._rollout(firsts[k].prompt_index, out.outputs[0]), sampling.stop)
        return firsts

    @staticmethod
    def _continued(requests: list[dict], first: Rollout) -> list[int]:
        return list(requests[first.prompt_index]["prompt_token_ids"]) + first.response_ids.tolist()

    def _joined(self, first: Rollout, rest: Rollout, stop: list[str]) -> Rollout:
        """A FIRE sample: its first token and its continuation as one rollout, cut at a stop string that began in the
        first token and ended in the continuation (which neither request could see whole)."""
        ids = torch.cat([first.response_ids, rest.response_ids])
        logps = None
        if first.logprobs is not None and rest.logprobs is not None:
            logps = torch.cat([first.logprobs, rest.logprobs])
        reason, cut = rest.finish_reason, _straddling_stop(self.tokenizer, ids.tolist(), stop)
        if cut is not None:
            ids, reason = ids[:cut], "stop"
            logps = logps[:cut] if logps is not None else None
        return Rollout(first.prompt_index, ids, self.tokenizer.decode(ids, skip_special_tokens=True), reason, logps)

    def _request(self, prompt: EncodedPrompt) -> dict:
        if prompt.videos:
            raise NotImplementedError(
                "the vllm engine does not take video prompts yet (vlrft hands vLLM images only); use rollout.engine=hf"
            )
        ids = prompt.input_ids.tolist() if torch.is_tensor(prompt.input_ids) else list(prompt.input_ids)
        images = list(prompt.images or [])
        if not images:
            return {"prompt_token_ids": ids}
        return {
            "prompt_token_ids": collapse_image_pads(ids, self.image_pad_id),
            "multi_modal_data": {"image": images},
        }

    def _rollout(self, index: int, sample) -> Rollout:
        ids = list(sample.token_ids)
        logps = [float(step[tok].logprob) for tok, step in zip(ids, sample.logprobs or [])]
        reason = "stop" if sample.finish_reason == "stop" else "length"
        return Rollout(
            index,
            torch.tensor(ids, dtype=torch.long),
            self.tokenizer.decode(ids, skip_special_tokens=True),
            reason,
            torch.tensor(logps, dtype=torch.float32) if len(logps) == len(ids) else None,
        )


def _straddling_stop(tokenizer, ids: list[int], stop: list[str]) -> int | None:
    """The length of the shortest prefix of ``ids`` (two tokens or more) whose text holds a stop string that its first
    token's text does not, looked for only while the text is short enough for the stop string to begin in the first
    token; None when there is none."""
    if not stop or len(ids) < 2:
        return None
    head = tokenizer.decode(ids[:1], skip_special_tokens=True)
    reach = len(head) + max(len(s) for s in stop)
    for k in range(2, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if any(s in text and s not in head for s in stop):
            return k
        if len(text) >= reach:
            return None
    return None


@register_engine("vllm", "a colocated vLLM engine, weights synced after each update, see docs/train-policy.md")
def build_vllm_engine(
    cfg: VLLMConfig, model: torch.nn.Module, processor, *, distributed: bool = False, seed: int = 0, **_
) -> VLLMRolloutEngine:
    """A vLLM engine on ``model``'s folder (``name_or_path``), in ``model``'s dtype unless ``cfg.dtype`` says
    otherwise; ``distributed``: one engine in each torchrun rank."""
    dtype = next(model.parameters()).dtype
    return VLLMRolloutEngine(model.name_or_path, processor, cfg, model_dtype=dtype, distributed=distributed, seed=seed)


def vllm_plugin() -> None:
    """vLLM's general plugin hook (entry point ``vllm.general_plugins`` in pyproject.toml): vLLM calls it in each
    process it runs, the OpenAI-compatible server's front end and its engine-core process included, so that
    ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``) serves a Qwen-VL model without torchvision
    (docs/reward-models.md). Where torchvision imports it changes nothing."""
    if not torchvision_available():
        _image_only_processors()


def _image_only_processors() -> None:
    """vLLM builds a stock Qwen-VL processor itself (``processor_cls.from_pretrained``), which insists on a
    video processor, which needs torchvision. Without torchvision, hand it the image-only subclass (its
    type check passes) by wrapping the processor getter of vLLM's processor module (in-process engine),
    and make its Qwen-VL modality limits name images only (else it asks that processor for video kwargs)."""
    # optional heavy dependency (vLLM): imported only when this engine is built
    from vllm.model_executor.models import qwen2_vl as vllm_qwen2_vl
    from vllm.transformers_utils import processor as vllm_processor

    original = vllm_processor.cached_get_processor
    if getattr(original, "vlrft_image_only", False):
        return
    vllm_qwen2_vl.Qwen2VLProcessingInfo.get_supported_mm_limits = lambda self: {"image": None}
    _image_only_qwen3_vl()

    def get(processor_name, *args, processor_cls=None, **kwargs):
        if processor_cls is not None:
            processor_cls = IMAGE_ONLY_PROCESSORS.get(processor_cls, processor_cls)
            kwargs["processor_cls"] = processor_cls
        return original(processor_name, *args, **kwargs)

    get.vlrft_image_only = True
    vllm_processor.cached_get_processor = get


def _image_only_qwen3_vl() -> None:
    """vLLM's Qwen3-VL processing info (a subclass of Qwen2-VL's, whose image-only modality limits it inherits):
    the processor kwargs it routes without a video processor's (it adds Qwen3-VL's video pixel bounds to them,
    which needs the video entry), and the most tokens per item of images only (no video processor to ask)."""
    try:
        from vllm.model_executor.models import qwen3_vl as vllm_qwen3_vl
    except ImportError:  # a vLLM without Qwen3-VL
        return
    info = vllm_qwen3_vl.Qwen3VLProcessingInfo

    def kwargs(self) -> dict[str, set[str]]:
        return {**super(info, self).get_supported_mm_processor_kwargs(), "videos_kwargs": set()}

    info.get_supported_mm_processor_kwargs = kwargs
    info.get_mm_max_tokens_per_item = lambda self, seq_len, mm_counts: {"image": self.get_max_image_tokens()}


def _cpu_stream(named_params: Iterable[tuple[str, torch.Tensor]]):
    """The strategy's stream as vLLM's loader takes it (plain tensors; gathered ones are already whole)."""
    for name, tensor in named_params:
        yield name, tensor.detach()
