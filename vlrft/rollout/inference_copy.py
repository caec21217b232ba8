"""The ``hf`` engine on an inference copy (``rollout.hf.inference_copy``): a plain, unwrapped model loaded from
the policy's folder in the rollout dtype (bf16 on CUDA), refreshed after each update from
``Strategy.full_params()`` (the stream the vllm engine reads) and freed while the policy trains (``sleep``: moved to
page-locked CPU memory, kept or dropped, as ``rollout.hf.sleep_level`` says). It generates instead of the training
module, through the same generate loop (:class:`~vlrft.rollout.hf_engine.HFRolloutEngine`): no FSDP2 / ZeRO-3 gather
and no fp32 -> bf16 cast per decode step, no lockstep between ranks (each rank holds a whole copy), prefill once per
prompt everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from data_pipelines.collate import EncodedPrompt
from vlrft.config import ConfigError
from vlrft.models.loading import load_model
from vlrft.rollout.base import Rollout, SamplingParams
from vlrft.rollout.hf_engine import HFRolloutEngine


class InferenceCopyEngine(HFRolloutEngine):
    """The hf engine generating with its own copy of the policy (``copy``), which :meth:`update_weights` keeps in
    step with the policy and :meth:`sleep` frees while the policy trains."""

    owns_weights = True  # loaded once from the policy's folder, then written by the weight stream

    def __init__(
        self,
        policy: torch.nn.Module,
        processor,
        *,
        dtype: torch.dtype,
        micro_batch_size: int = 16,
        static_cache: bool = False,
        sleep_level: int = 1,
        device: torch.device | None = None,
        routing_replay: bool = False,
    ):
        """``policy``: the training module (its folder is loaded, its generation config names the EOS tokens); the
        copy is held in ``dtype`` on ``device``, where the policy computes (by default its parameters' device), and
        needs no lockstep between ranks, sharded policy or not. ``sleep_level``: what :meth:`sleep` does with the
        copy (``HFEngineConfig.sleep_level``)."""
        super().__init__(
            policy,
            processor,
            micro_batch_size=micro_batch_size,
            static_cache=static_cache,
            sleep_level=sleep_level,
            device=device,
            routing_replay=routing_replay,
        )
        self.copy = load_inference_copy(policy, dtype, self.device)
        self.model = self.copy  # the module that generates
        self.params = dict(self.copy.named_parameters())
        self._dropped: dict[str, torch.Size] = {}  # the copy's weights sleep dropped (sleep_level 2)
        self._unfilled: set[str] = set()  # woken, not yet re-sent by the weight stream
        self._host: HostCopy | None = None  # where sleep_level 1 keeps the copy's weights on a GPU (made once)

    @property
    def needs_all_params(self) -> bool:
        """Whether the weight stream must carry frozen parameters too: only when sleep drops the copy's weights (the
        copy keeps frozen ones, a frozen vision tower say, from its load)."""
        return self.sleep_level == 2

    @property
    def weight_dtype(self) -> torch.dtype:
        """The copy's dtype (the stream is cast to it)."""
        return self.copy.dtype

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the stream into the inference copy (cast to its dtype)."""
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
        self._release_static_caches()
        if self.sleep_level == 2 and not self._dropped:
            for name, p in self.params.items():
                self._dropped[name] = p.shape
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        elif self.sleep_level == 1 and self.device.type != "cpu" and not self._asleep():
            if self._host is None:
                self._host = HostCopy(self.params, pin=self.device.type == "cuda")
            self._host.offload(self.params)
        if self.sleep_level and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
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

    def generate(self, prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        self.wake()  # a no-op when awake
        if self._unfilled:  # sleep_level 2 dropped them and no update_weights has written them since
            raise RuntimeError(
                f"hf inference copy: generate after rollout.hf.sleep_level=2 dropped {len(self._unfilled)} "
                "weights and before update_weights re-sent them; call update_weights after wake"
            )
        return super().generate(prompts, sampling)


def load_inference_copy(policy: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A plain model of the policy's folder (``name_or_path``) in ``dtype`` on ``device``, in eval mode, without
    gradients, computing as the policy does: where a module of the policy carries ``prepare_copy`` (the strategy
    changed the kernels its products take), that hook makes the copy take them too.
    Its weights are the folder's until the first :meth:`InferenceCopyEngine.update_weights`."""
    folder = getattr(policy, "name_or_path", "") or ""
    if not folder or not Path(folder).is_dir():
        raise ConfigError(
            f"rollout.hf.inference_copy: the policy has no model folder to load the copy from (name_or_path="
            f"{folder!r}); set rollout.hf.inference_copy=off"
        )
    copy, _ = load_model(folder, dtype, device, processor=False)
    prepare = next((m.prepare_copy for m in policy.modules() if hasattr(m, "prepare_copy")), None)
    if prepare is not None:  # computes as the policy does
        prepare(copy)
    return copy.eval().requires_grad_(False)


class HostCopy:
    """The inference copy's weights in CPU memory while it sleeps (``sleep_level`` 1 on a GPU): buffers made at the
    first sleep and reused at every later one, page-locked on CUDA (``pin``), so each sleep and wake is one DMA
    transfer per weight instead of ``Module.to``'s copies through fresh pageable memory (measured 1.6-1.9 GB/s,
    about 4 s a step at 3B on an H200) and no host allocation after the first step.

    torch's page-locked allocator rounds every allocation up to a power of two, so one buffer for a whole copy could
    take up to twice its size (a 9 GiB copy 16 GiB); the weights are packed into buffers of ``CHUNK`` bytes (one
    of the next power of two for a weight larger than that) instead, which waste at most the tail each leaves
    (:func:`host_layout`). Each weight's view starts at a multiple of ``ALIGN`` bytes (any dtype's alignment)."""

    ALIGN = 64
    CHUNK = 1 << 30

    def __init__(self, params: dict[str, torch.Tensor], pin: bool):
        sizes = [p.numel() * p.element_size() for p in params.values()]
        places, used = host_layout(sizes, self.CHUNK, self.ALIGN)
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


def host_layout(sizes: list[int], chunk: int, align: int) -> tuple[list[tuple[int, int]], list[int]]:
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
