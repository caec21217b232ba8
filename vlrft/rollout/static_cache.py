"""The hf engine's compiled decode (``rollout.hf.compile``): the static KV caches it decodes on.

The prefill's cache (once per prompt, expanded to its n samples) is copied into a transformers
:class:`StaticCache` of a bucketed length, on which ``generate`` compiles the decode step (torch.compile, CUDA
graphs) by its own criteria; on CPU the same static cache runs eagerly and samples the same tokens. The caches are
kept and reused from rollout to rollout while the weights stay put (``rollout.hf.sleep_level=0``), so the captured
decode step replays at every rollout instead of being recorded again.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

# static caches are allocated in lengths of this many tokens, so that prompts of similar width share one
# compiled decode step (a new cache length means a new graph)
STATIC_CACHE_BUCKET = 256


class StaticCaches:
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
