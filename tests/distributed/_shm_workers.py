"""Rank functions for the shared-memory transport tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from halopipe.distributed import DistributedError
from halopipe.distributed.comm import Comm, Gathered

CAPACITY = 64 << 10  # the smallest buffer: the larger messages and reductions below go through gloo


def _payload(src: int, dst: int, rows: int) -> torch.Tensor:
    """A message from ``src`` to ``dst`` that the receiver can predict."""
    return torch.arange(rows * 3, dtype=torch.float64).reshape(rows, 3) * (src + 1) + 0.001 * dst


def traffic(capacity: int) -> dict:
    """Reductions, point-to-point messages and all-to-alls of sizes below and above ``capacity``; every result checked here."""
    os.environ["HALOPIPE_SHM_CAPACITY"] = str(capacity)  # read when this process makes its first communicator
    comm = Comm(timeout=60.0)
    r, p = comm.rank, comm.size
    reductions = []
    for numel in (1, 9, 3000, 2 * CAPACITY // 8):  # the last one exceeds a 64 KiB slot
        x = (torch.arange(numel, dtype=torch.float64) + 0.1) / (r + 1)
        total = comm.all_reduce(x)
        expected = sum((torch.arange(numel, dtype=torch.float64) + 0.1) / (k + 1) for k in range(p))
        assert torch.allclose(total, expected, rtol=1e-15, atol=0), numel
        assert torch.equal(comm.all_reduce(x, "max"), torch.arange(numel, dtype=torch.float64) + 0.1)
        assert torch.equal(comm.all_reduce(x, "min"), (torch.arange(numel, dtype=torch.float64) + 0.1) / p)
        reductions.append(total)
    assert torch.equal(comm.all_reduce(torch.tensor([r + 1], dtype=torch.int64)), torch.tensor([p * (p + 1) // 2]))
    for rows in (0, 1, 500, CAPACITY // 24 + 1):  # empty, small, large, just over a 64 KiB mailbox
        for _ in range(2):  # a second message on each pair reuses the mailbox
            sends = {q: _payload(r, q, rows) for q in range(p) if q != r}
            got = comm.exchange(sends, {q: (rows, 3) for q in range(p) if q != r}, torch.float64, torch.device("cpu"))
            for q in range(p):
                if q != r:
                    assert torch.equal(got[q], _payload(q, r, rows)), (rows, q)
        for _ in range(2):  # gathered into the mailboxes as they are sent, read where they lie as they arrive
            every = torch.cat([_payload(r, q, rows) for q in range(p)])  # each destination's rows, one after another
            sends = {q: Gathered(every, torch.arange(q * rows * 3, (q + 1) * rows * 3), (rows, 3)) for q in range(p) if q != r}
            kept = comm.exchange(
                sends,
                {q: (rows, 3) for q in range(p) if q != r},
                torch.float64,
                torch.device("cpu"),
                consume=lambda arrived: {q: t.clone() for q, t in arrived.items()},
            )
            for q in range(p):
                if q != r:
                    assert torch.equal(kept[q], _payload(q, r, rows)), (rows, q)
        for _ in range(2):  # an all-to-all whose pieces, sent and received, are strided views (columns of one tensor)
            source = torch.stack([_payload(r, q, rows) for q in range(p)], dim=1)
            result = torch.full((rows, p, 3), -1.0, dtype=torch.float64)
            comm.all_to_all_into([source[:, q] for q in range(p)], [result[:, q] for q in range(p)])
            for q in range(p):
                assert torch.equal(result[:, q], _payload(q, r, rows)), (rows, q)
    return {"shared_memory": comm._shm is not None, "reductions": [t.tolist() for t in reductions]}


def die_in_a_reduction(directory: str) -> None:
    """Rank 1 exits without a word before a reduction; rank 0 records what its shared-memory wait raised, and when."""
    comm = Comm(timeout=60.0)
    assert comm._shm is not None, "this test needs the shared-memory path"
    comm.all_reduce(torch.ones(3))  # both ranks are set up
    if comm.rank == 1:
        Path(directory, "died").write_text(str(time.time()))
        os._exit(3)
    try:
        comm.all_reduce(torch.ones(3))
    except DistributedError as exc:
        Path(directory, "rank0").write_text(f"{time.time()}\n{exc}")
        raise
