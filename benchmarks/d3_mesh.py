"""Particle-mesh D3(BJ) side by side: halopipe ``DFTD3Mesh`` (1 and 2 ranks), s-dftd3 at 50.2 Å, nvalchemi-ops FourierD3.

Every row is one structure and one code, energy + forces (what an MD step
asks for), one thread per process. Rounds interleave the codes (halopipe,
halopipe on 2 ranks, s-dftd3, nvalchemi, then again), each measurement is the
best of ``--repeats`` calls after one untimed call (kernel compilation, plans,
the FFT library's first use), and a row keeps the best over ``--rounds``.

* halopipe: ``Pipeline([Group([Step(DFTD3Mesh("pbe", accuracy=A))], autograd=True)])``
  called on the same ``System`` again and again as a user calls it (the mesh
  kernel and the decomposition are reused while the cell is constant); the
  coordination numbers by lattice sums at s-dftd3's 40 bohr CN cutoff; 2 ranks:
  :func:`~halopipe.distributed.launch.spawn` (gloo), the system scattered once
  into a :class:`~halopipe.distributed.ShardedSystem`, the time the slowest rank's.
* s-dftd3 (``dftd3`` Python API): ``DispersionModel.get_dispersion(
  RationalDampingParam(method="pbe", atm=False), grad=True)`` on one model with its
  real-space cutoffs 50.2 Å (two-body, sqrt(9000) bohr) and 40 bohr (CN); skipped
  above ``--sdftd3-max-atoms`` (it grows as N x cutoff^3: minutes at 32,768 atoms).
* nvalchemi-toolkit-ops ``fourier_dftd3`` (with ``--nvalchemi-python``, the Python
  of a venv where ``nvalchemiops`` imports; run in a subprocess of that Python):
  halopipe's reference tables (those of s-dftd3) decomposed to ``--nv-tolerance``,
  a ``--nv-spacing`` bohr mesh (1 bohr, as the issue measured), B-spline order
  ``--nv-order``, its CN neighbour list at ``--nv-cn-cutoff`` bohr built once and
  not timed (its counting function is its own, tapered to zero at that cutoff),
  the ``FourierD3Setup`` built once; the call is timed.

Energy column: ``|E - E_ref| / |E_ref|`` against the converged two-body sum,
``DFTD3Mesh`` at ``--reference-accuracy`` (mesh and rank tolerance), one process,
untimed. Ratio column: seconds over halopipe's one-process seconds for the same case.

    python benchmarks/d3_mesh.py --sizes 512 4096 --cases mgo-512 --nvalchemi-python /work/venv-nvops/bin/python
    python benchmarks/d3_mesh.py --scaling --sizes 512 4096 32768 --plot docs/d3_mesh_scaling.png

``--scaling``: halopipe alone (1 process, and 2 ranks unless ``--nproc 1``) over
``--sizes`` of each of ``--kinds`` (Si, MgO), written to a CSV next to ``--plot`` (a PNG of seconds vs atoms
with an N log N guide, when matplotlib imports).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _common import print_table, timed  # noqa: E402

BOHR = 0.52917721067  # Å (ASE's, as the positions reach s-dftd3)
HARTREE = 27.211386024367243  # eV
SDFTD3_CUTOFF = math.sqrt(9000.0) * BOHR  # 50.2 Å
CN_CUTOFF_BOHR = 40.0


# ------------------------------------------------------------------ structures
def build(case: str):
    """``si-N`` (rattled diamond Si, N = 8 n^3) or ``mgo-N`` (rattled rock-salt MgO, N = 8 n^3); fixed seeds."""
    from ase.build import bulk

    kind, _, size = case.partition("-")
    n = round((int(size) / 8) ** (1.0 / 3.0))
    if 8 * n**3 != int(size):
        raise ValueError(f"{case}: the atom count must be 8 n^3 (512, 4096, 13824, 32768, ...)")
    if kind == "si":
        atoms, seed = bulk("Si", "diamond", a=5.43, cubic=True).repeat((n,) * 3), 0
    elif kind == "mgo":
        atoms, seed = bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((n,) * 3), 1
    else:
        raise ValueError(f"unknown case {case!r}: si-N or mgo-N")
    atoms.positions += np.random.default_rng(seed).normal(0.0, 0.05, atoms.positions.shape)
    return atoms


FUNCTIONAL = "pbe"


# ------------------------------------------------------------------ halopipe
def halopipe_worker(case: str, accuracy: float, repeats: int) -> dict:
    """One rank (or the one process): scatter the case, one untimed call, then the best of ``repeats`` E+F calls."""
    import torch.distributed as dist

    from halopipe import Group, Pipeline, Step, System, keep_freed_memory
    from halopipe.distributed import ShardedSystem
    from halopipe.models.dftd3_mesh import DFTD3Mesh

    torch.set_num_threads(1)
    keep_freed_memory()  # as halopipe's launcher does in every rank, so the one-process row runs under the same policy
    model = DFTD3Mesh(FUNCTIONAL, accuracy=accuracy)
    pipeline = Pipeline([Group([Step(model)], autograd=True)])
    if dist.is_initialized():
        system = System.from_ase(build(case)) if dist.get_rank() == 0 else None
        system = ShardedSystem.scatter(system, pipeline.config)
    else:
        system = System.from_ase(build(case))
    pipeline(system)
    seconds, out = timed(lambda: pipeline(system), repeats)
    if dist.is_initialized():  # the slowest rank's time
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = float(t)
    spacing = model.spacing(model.decomposition.species)
    note = f"rank {model.decomposition.rank}, h {spacing:.3f} Å, order {model.order}"
    return {"seconds": seconds, "energy": float(out["energy"]), "note": note}


def halopipe_case(case: str, accuracy: float, repeats: int, nproc: int) -> dict:
    from halopipe.distributed.launch import spawn  # not at the top: the nvalchemi worker runs in a venv without halopipe's dependencies

    if nproc == 1:
        return halopipe_worker(case, accuracy, repeats)
    return spawn(halopipe_worker, nproc, case, accuracy, repeats, timeout=3600, threads=1)[0]


def reference_energy(case: str, accuracy: float) -> float:
    """The converged two-body energy: ``DFTD3Mesh`` at a tight accuracy and rank tolerance, one process."""
    from halopipe import Group, Pipeline, Step, System
    from halopipe.models.dftd3_mesh import DFTD3Mesh

    pipeline = Pipeline([Group([Step(DFTD3Mesh(FUNCTIONAL, accuracy=accuracy))], autograd=True)])
    return float(pipeline(System.from_ase(build(case)))["energy"])


# ------------------------------------------------------------------ s-dftd3
def sdftd3_case(case: str, repeats: int) -> dict:
    from dftd3.interface import DispersionModel, RationalDampingParam

    atoms = build(case)
    model = DispersionModel(atoms.numbers, atoms.positions / BOHR, atoms.cell.array / BOHR, np.ones(3, dtype=bool))
    model.set_realspace_cutoff(SDFTD3_CUTOFF / BOHR, CN_CUTOFF_BOHR, CN_CUTOFF_BOHR)
    param = RationalDampingParam(method=FUNCTIONAL, atm=False)
    model.get_dispersion(param, grad=True)
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.get_dispersion(param, grad=True)
        best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "energy": float(out["energy"]) * HARTREE, "note": f"cutoff {SDFTD3_CUTOFF:.1f} Å, CN 40 bohr"}


# ------------------------------------------------------------------ nvalchemi-toolkit-ops (subprocess)
def write_nvalchemi_input(case: str, path: str) -> None:
    """Positions, cell and numbers (bohr), and halopipe's D3 tables in the layout ``FourierD3Parameters.from_tables`` takes."""
    from halopipe.models.dftd3 import DFTD3, _reference

    atoms = build(case)
    d, model = _reference(), DFTD3(FUNCTIONAL)
    n_ref, ref_cn = d["n_ref"], d["ref_cn"]
    slots = np.arange(ref_cn.shape[1])
    ref_cn = np.where(slots[None, :] < n_ref[:, None], ref_cn, -1.0)
    z = ref_cn.shape[0]
    np.savez(
        path,
        positions=atoms.positions / BOHR,
        cell=atoms.cell.array / BOHR,
        numbers=atoms.numbers,
        c6ab=d["c6"],  # Hartree bohr^6
        cn_ref=np.broadcast_to(ref_cn[:, None, :, None], (z, z) + (ref_cn.shape[1],) * 2),  # Grimme's pair-indexed form
        rcov=model.rcov.numpy() / BOHR,  # k2 = 4/3 folded in, bohr
        r4r2=model.q.numpy() / BOHR,  # sqrt(0.5 <r4>/<r2> sqrt(Z)), bohr
        params=np.array([model.params[k] for k in ("s6", "s8", "a1", "a2")]),
    )


def nvalchemi_worker(path: str, repeats: int, spacing: float, order: int, tolerance: float, cn_cutoff: float) -> dict:
    """Runs in the nvalchemi venv: prebuilt CN list, parameters and setup; the best of ``repeats`` timed calls."""
    from nvalchemiops.torch.interactions.dispersion import FourierD3Parameters, FourierD3Setup, fourier_dftd3
    from nvalchemiops.torch.neighbors import neighbor_list

    torch.set_num_threads(1)
    data = np.load(path)
    t = {k: torch.as_tensor(data[k]) for k in data.files}
    positions, cell, numbers = t["positions"], t["cell"], t["numbers"].to(torch.int32)
    species = sorted({int(z) for z in data["numbers"]})
    params = FourierD3Parameters.from_tables(t["rcov"], t["r4r2"], t["c6ab"], t["cn_ref"], species, tol=tolerance)
    pairs, pointer, shifts = neighbor_list(positions, cn_cutoff, cell=cell, pbc=torch.ones(3, dtype=torch.bool), return_neighbor_list=True)
    lengths = torch.linalg.norm(cell, dim=1)
    mesh = tuple(_fft_friendly(math.ceil(float(n) / spacing)) for n in lengths)
    setup = FourierD3Setup.build(cell, params.n_species, mesh, spline_order=order)
    s6, s8, a1, a2 = (float(x) for x in data["params"])

    def call():
        return fourier_dftd3(
            positions, numbers, a1, a2, s8, s6=s6, fourier_d3_params=params, cell=cell, cutoff=cn_cutoff, setup=setup,
            neighbor_list=pairs, neighbor_ptr=pointer, unit_shifts=shifts,
        )  # fmt: skip

    call()
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        best = min(best, time.perf_counter() - t0)
    edges = f"CN list {cn_cutoff:g} bohr ({pairs.shape[1]} edges, untimed)"
    note = f"rank {params.rank}, mesh {'x'.join(map(str, mesh))}, order {order}, {edges}"
    return {"seconds": best, "energy": float(out[0].sum()) * HARTREE, "note": note}


def _fft_friendly(n: int) -> int:
    """The smallest integer >= n whose only prime factors are 2, 3, 5 and 7 (as nvalchemi rounds a spacing)."""
    while True:
        m = n
        for p in (2, 3, 5, 7):
            while m % p == 0:
                m //= p
        if m == 1:
            return n
        n += 1


def nvalchemi_case(case: str, python: str, repeats: int, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.npz")
        write_nvalchemi_input(case, path)
        command = [python, str(Path(__file__).resolve()), "--nvalchemi-worker", path, "--repeats", str(repeats)]
        command += ["--nv-spacing", str(args.nv_spacing), "--nv-order", str(args.nv_order), "--nv-tolerance", str(args.nv_tolerance)]
        command += ["--nv-cn-cutoff", str(args.nv_cn_cutoff)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"nvalchemi worker failed:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


def nvalchemi_importable(python: str | None) -> bool:
    if not python:
        return False
    done = subprocess.run([python, "-c", "import nvalchemiops.torch.interactions.dispersion"], capture_output=True)
    return done.returncode == 0


# ------------------------------------------------------------------ tables
def side_by_side(args) -> None:
    cases = [f"si-{n}" for n in args.sizes] + list(args.cases)
    codes = [f"halopipe {p} rank{'s' if p > 1 else ''}" for p in args.nproc] + ["s-dftd3"]
    have_nv = nvalchemi_importable(args.nvalchemi_python)
    if have_nv:
        codes.append("nvalchemi FourierD3")
    elif args.nvalchemi_python:
        print(f"nvalchemiops does not import in {args.nvalchemi_python}: its rows are left out", flush=True)
    best: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for case in cases:
            n_atoms = int(case.partition("-")[2])
            for code in codes:
                if code == "s-dftd3" and n_atoms > args.sdftd3_max_atoms:
                    continue
                if code.startswith("halopipe"):
                    res = halopipe_case(case, args.accuracy, args.repeats, int(code.split()[1]))
                elif code == "s-dftd3":
                    res = sdftd3_case(case, args.repeats)
                else:
                    res = nvalchemi_case(case, args.nvalchemi_python, args.repeats, args)
                print(f"round {r + 1} {case} {code}: {res['seconds']:.4f} s, E {res['energy']:.6f} eV", flush=True)
                key = (case, code)
                if key not in best or res["seconds"] < best[key]["seconds"]:
                    best[key] = res
    rows = []
    for case in cases:
        ref = reference_energy(case, args.reference_accuracy)
        base = best.get((case, codes[0]))
        for code in codes:
            res = best.get((case, code))
            if res is None:
                continue
            ratio = res["seconds"] / base["seconds"] if base else float("nan")
            error = abs(res["energy"] - ref) / abs(ref)
            rows.append([case, code, f"{res['seconds']:.4f}", f"{ratio:.2f}x", f"{error:.1e}", res["note"]])
    header = ["case", "code", "s / E+F", "vs halopipe 1 rank", "|dE|/E vs converged", "note"]
    title = f"D3(BJ, PBE) two-body E+F, 1 thread per process, best of {args.repeats} x {args.rounds} rounds"
    title += f"; halopipe accuracy {args.accuracy:g}"
    print_table(title, header, rows)


def scaling(args) -> None:
    rows = []
    for kind in args.kinds:
        for n in args.sizes:
            row = {"case": f"{kind}-{n}", "atoms": n}
            for p in args.nproc:
                runs = [halopipe_case(f"{kind}-{n}", args.accuracy, args.repeats, p) for _ in range(args.rounds)]
                row[f"seconds_{p}"] = min(run["seconds"] for run in runs)
            rows.append(row)
            print(row, flush=True)
    out = Path(args.plot)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib does not import: wrote {out.with_suffix('.csv')} only")
        return
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    names = {"si": "diamond Si", "mgo": "rock-salt MgO"}
    for kind, marker in zip(args.kinds, "os^v"):
        mine = [r for r in rows if r["case"].startswith(kind + "-")]
        atoms = np.array([r["atoms"] for r in mine], dtype=float)
        for p, style in zip(args.nproc, ("-", ":", "-.")):
            seconds = np.array([r[f"seconds_{p}"] for r in mine])
            ax.loglog(atoms, seconds, marker + style, label=f"{names.get(kind, kind)}, {p} rank{'s' if p > 1 else ''}")
        if kind == args.kinds[0]:
            first = mine[0][f"seconds_{args.nproc[0]}"]
            ax.loglog(atoms, first * atoms * np.log(atoms) / (atoms[0] * np.log(atoms[0])), "k--", lw=1, label="N log N")
    ax.set_xlabel("atoms (rattled crystals)")
    ax.set_ylabel("seconds per energy + forces")
    ax.set_title(f"D3(BJ) by particle mesh, accuracy {args.accuracy:g}, 1 thread/rank", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    print(f"wrote {out} and {out.with_suffix('.csv')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 4096], help="Si atom counts, 8 n^3 (up to 32768)")
    parser.add_argument("--cases", nargs="*", default=["mgo-512"], help="other structures: mgo-N (rock-salt MgO, 8 n^3 atoms)")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="halopipe ranks per row")
    parser.add_argument("--accuracy", type=float, default=1e-4, help="DFTD3Mesh accuracy (relative two-body energy)")
    parser.add_argument("--reference-accuracy", type=float, default=1e-7, help="accuracy of the converged reference")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (best kept)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (best kept)")
    parser.add_argument("--sdftd3-max-atoms", type=int, default=4096, help="skip s-dftd3 above this many atoms")
    parser.add_argument("--nvalchemi-python", help="Python of a venv where nvalchemiops imports (its rows are left out otherwise)")
    parser.add_argument("--nv-spacing", type=float, default=1.0, help="nvalchemi mesh spacing, bohr")
    parser.add_argument("--nv-order", type=int, default=4, help="nvalchemi B-spline order")
    parser.add_argument("--nv-tolerance", type=float, default=1e-4, help="nvalchemi C6 decomposition tolerance")
    parser.add_argument("--nv-cn-cutoff", type=float, default=CN_CUTOFF_BOHR, help="nvalchemi CN list cutoff, bohr")
    parser.add_argument("--scaling", action="store_true", help="halopipe time vs N over --sizes: CSV and PNG at --plot")
    parser.add_argument("--plot", default="d3_mesh_scaling.png", help="PNG path of --scaling (the CSV goes next to it)")
    parser.add_argument("--kinds", nargs="+", default=["si", "mgo"], help="--scaling: crystals, si and/or mgo (8 n^3 atoms each)")
    parser.add_argument("--nvalchemi-worker", metavar="NPZ", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.nvalchemi_worker:
        res = nvalchemi_worker(args.nvalchemi_worker, args.repeats, args.nv_spacing, args.nv_order, args.nv_tolerance, args.nv_cn_cutoff)
        print(json.dumps(res))
        return 0
    if args.scaling:
        scaling(args)
    else:
        side_by_side(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
