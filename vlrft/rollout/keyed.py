"""Keyed sampling (``SamplingParams.keys``): noise that is a pure function of (key, sample, position, token).

Each uniform is a counter-based hash, SplitMix64's output function (Steele, Lea and Flood 2014, "Fast splittable
pseudorandom number generators", OOPSLA; the finaliser of Stafford's "Mix13", the same in Java's ``SplittableRandom``)
applied to a counter built from the row's key, the decode position and the token id, on int64 tensors (wrapping
multiplication, logical right shifts emulated by masking). So a row's noise does not depend on the other rows of its
batch, on the device, or on any RNG state, and the token drawn from it by the Gumbel-max trick (Gumbel 1954; Maddison
et al. 2014, "A* Sampling", Sec. 2: ``argmax_i(log p_i + G_i)`` with ``G_i = -log(-log U_i)`` i.i.d. standard Gumbel
is distributed as ``p``) is a sample of exactly the distribution given, the same wherever it is drawn.
"""

from __future__ import annotations

import torch

GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (2**64 / golden ratio, odd)
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # its output function's multipliers
_U64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """The int64 value with the bits of the unsigned 64-bit integer ``x``."""
    x &= _U64
    return x - (1 << 64) if x >> 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` on a signed tensor is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors, bit for bit the unsigned 64-bit one (two's complement: int64
    multiplication wraps modulo 2**64 as uint64's does)."""
    x = (x ^ _shr(x, 30)) * _i64(_M1)
    x = (x ^ _shr(x, 27)) * _i64(_M2)
    return x ^ _shr(x, 31)


def _counter(x: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """SplitMix64's ``index``-th output of the stream whose state is ``x``: ``mix64(x + (index + 1) * GOLDEN)``."""
    if isinstance(index, int):  # wrapped here: a Python int does not wrap at 64 bits
        return mix64(x + _i64((index + 1) * GOLDEN))
    return mix64(x + (index + 1) * _i64(GOLDEN))


def row_keys(keys: list[int], n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[len(keys) * n]`` int64 keys of the rows of a ``generate`` call, prompt-major (row ``r``: prompt ``r // n``,
    sample ``r % n``): sample ``j`` of a prompt keyed ``k`` is the ``j``-th output of the stream of ``k``, so the n
    samples of a prompt draw distinct noise."""
    k = torch.tensor(keys, dtype=torch.long, device=device).repeat_interleave(n)
    j = torch.arange(n, dtype=torch.long, device=device).repeat(len(keys))
    return _counter(k, j)


def keyed_uniform(
    keys: torch.Tensor, position: int, vocab: int, device: torch.device | str | None = None, start: int = 0
) -> torch.Tensor:
    """``[B, vocab - start]`` float64 uniforms in (0, 1) for rows keyed ``keys`` (``[B]`` int64, :func:`row_keys`) at
    decode ``position`` (response tokens so far), for tokens ``start`` to ``vocab - 1``: token ``t`` of row ``b`` is
    the top 53 bits of ``mix64(mix64(keys[b] + (position + 1) G) + (t + 1) G)``, plus a half, times 2**-53 (never 0
    or 1). A pure function of (key, position, token): bitwise the same for a row alone or among others, for a token
    in any slice of the vocabulary, on any device."""
    step = _counter(keys.to(device=device, dtype=torch.long), position)  # [B]
    tokens = torch.arange(start, vocab, dtype=torch.long, device=step.device)
    bits = _shr(_counter(step[:, None], tokens[None]), 11)  # [B, V - start] in [0, 2**53)
    return (bits.double() + 0.5) * 2.0**-53


# noise values computed at once by gumbel_max: its int64 and float64 temporaries are a few times 8 bytes each, so
# about 32 MB apiece (a whole 152k vocabulary for 512 rows would be 0.6 GB apiece, several at once)
NOISE_CHUNK = 1 << 22


def gumbel_max(logprobs: torch.Tensor, keys: torch.Tensor, position: int) -> torch.Tensor:
    """``[B]`` tokens drawn from ``softmax(logprobs)`` (``[B, V]``; ``-inf``: never drawn) with the keyed noise of
    ``keys`` at ``position``: ``argmax(logprobs + G)``, ``G = -log(-log U)`` (the Gumbel-max trick, module docstring),
    in float64. The vocabulary is taken in slices of about ``NOISE_CHUNK`` values, each slice's best kept where it is
    strictly better than the earlier slices' (so the first of equal maxima wins, as a single ``argmax`` does): the same
    tokens as over the whole vocabulary at once, in bounded memory."""
    rows, vocab = logprobs.shape
    width = max(1, NOISE_CHUNK // max(rows, 1))
    best_value = best_token = None
    for start in range(0, vocab, width):
        stop = min(vocab, start + width)
        u = keyed_uniform(keys, position, stop, logprobs.device, start=start)
        scores = logprobs[:, start:stop].double() - torch.log(-torch.log(u))
        token = scores.argmax(-1)
        value = scores.gather(-1, token[:, None]).squeeze(-1)
        token = token + start
        if best_value is None:
            best_value, best_token = value, token
        else:
            better = value > best_value
            best_value, best_token = torch.where(better, value, best_value), torch.where(better, token, best_token)
    return best_token
