"""Counter-based random numbers: the same noise for an atom on any rank.

A stateful generator hands out numbers in the order it is asked, so the noise
an atom receives would depend on which rank owns it and in which order. A
*counter-based* generator instead computes each number as a hash of its
coordinates ``(seed, stream, step, atom id, component)``: no state to carry,
nothing to synchronise, and a trajectory is the same on 1 or 64 ranks and
after a restart (the counter is just the step number).

The hash is SplitMix64 (Steele, Lea & Flood 2014) applied twice, written with
wrapping int64 torch arithmetic (logical right shifts are masked arithmetic
shifts), so it runs vectorised on any device. The top 53 bits give a uniform
number in (0, 1); Box-Muller turns pairs of uniforms into Gaussians.
"""

from __future__ import annotations

import math

import torch

__all__ = ["splitmix64", "uniform", "gaussian", "LANGEVIN", "VELOCITIES", "BAROSTAT"]

LANGEVIN = 1
"""Stream of the Langevin thermostat noise."""
VELOCITIES = 2
"""Stream of the Maxwell-Boltzmann initial velocities."""
BAROSTAT = 3
"""Stream of the stochastic cell rescaling noise (one number per step, id 0)."""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The SplitMix64 finaliser of ``x + golden``, on int64 tensors (bits as uint64)."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_M1)
    z = (z ^ _shr(z, 27)) * _signed(_M2)
    return z ^ _shr(z, 31)


def _splitmix64_int(x: int) -> int:
    """SplitMix64 on a Python integer (for keys; also the reference for tests)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _key(seed: int, stream: int, step: int) -> int:
    """One 64-bit key per (seed, stream, step), chaining the hash so nearby inputs decorrelate."""
    k = _splitmix64_int(int(seed) & _MASK64)
    k = _splitmix64_int(k ^ (int(stream) & _MASK64))
    return _splitmix64_int(k ^ (int(step) & _MASK64))


def uniform(seed: int, step: int, ids: torch.Tensor, dim: int, stream: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniform numbers in (0, 1), shape ``(len(ids), dim)``, one per (atom id, component).

    Parameters
    ----------
    seed, step, stream : integers selecting independent sequences.
    ids : (n,) int64 global atom ids; row ``i`` depends only on ``ids[i]``.
    dim : components per atom.
    """
    counters = ids.to(torch.int64)[:, None] * dim + torch.arange(dim, device=ids.device, dtype=torch.int64)
    bits = splitmix64(splitmix64(counters) ^ _signed(_key(seed, stream, step)))
    top = _shr(bits, 11)  # 53 random bits: exactly representable in float64
    return ((top.to(torch.float64) + 0.5) * 2.0**-53).to(dtype)


def gaussian(seed: int, step: int, ids: torch.Tensor, dim: int = 3, stream: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Standard normal numbers, shape ``(len(ids), dim)``, keyed like :func:`uniform`.

    Box-Muller on ``2 * ceil(dim / 2)`` uniforms per atom: pairs ``(u1, u2)``
    give ``sqrt(-2 ln u1) * (cos 2 pi u2, sin 2 pi u2)``.
    """
    pairs = (dim + 1) // 2
    u = uniform(seed, step, ids, 2 * pairs, stream, torch.float64)
    radius = torch.sqrt(-2.0 * torch.log(u[:, 0::2]))
    angle = 2.0 * math.pi * u[:, 1::2]
    z = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=2).reshape(len(ids), 2 * pairs)
    return z[:, :dim].to(dtype)
