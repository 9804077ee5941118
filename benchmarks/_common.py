"""Helpers shared by the benchmarks: timing on ranks and table printing."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn, repeats: int) -> tuple[float, object]:
    """(best wall seconds over ``repeats`` calls, last result), synchronised across ranks."""
    best, out = float("inf"), None
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        out = fn()
        barrier()
        best = min(best, time.perf_counter() - t0)
    return best, out


def max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[k])) for r in rows)) for k, h in enumerate(header)]
    print(f"\n{title}")
    print("| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |")
