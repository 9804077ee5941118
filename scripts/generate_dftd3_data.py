"""Generate ``halopipe/models/data/dftd3_reference.npz`` from published DFT-D3 values.

Source of the numbers
---------------------
The DFT-D3 reference values were published by S. Grimme, J. Antony, S. Ehrlich
and H. Krieg, J. Chem. Phys. 132, 154104 (2010) (reference C6 coefficients,
reference coordination numbers, <r4>/<r2> expectation values, pairwise cutoff
radii R0AB) with the covalent radii of P. Pyykkö and M. Atsumi, Chem. Eur. J. 15,
186 (2009) (metals reduced by 10 %), and the damping parameters of the cited
functional papers (Grimme et al. 2010; Grimme, Ehrlich, Goerigk, J. Comput.
Chem. 32, 1456 (2011); Ehlert et al., J. Chem. Phys. 154, 061101 (2021) for
r2SCAN, ...). We read them as distributed in two Apache-2.0 packages on PyPI,
which vendor them from s-dftd3 (https://github.com/dftd3/s-dftd3):

* ``tad-dftd3`` 0.7.0: ``reference-c6.pt`` (reference C6, a.u.), the reference
  coordination numbers (``reference.py``), <r4>/<r2> (``data/r4r2.py``) and the
  functional parameters (``param/parameters.toml``, vendored verbatim from
  s-dftd3 commit 41d5a07, plus ``param/aliases.toml``);
* ``tad-mctc`` 0.11.3: the covalent radii (``data/radii.py``, Å) and the pairwise
  R0AB radii (``data/vdw-pairwise.pt``, stored in bohr; converted back to the
  published Å values, which have four decimals).

Neither package is a dependency of halopipe. To regenerate::

    pip download --no-deps tad-dftd3==0.7.0 tad-mctc==0.11.3 -d /tmp/d3src
    python scripts/generate_dftd3_data.py /tmp/d3src/tad_dftd3-0.7.0-py3-none-any.whl \
        /tmp/d3src/tad_mctc-0.11.3-py3-none-any.whl

What is stored (all float64, compressed npz; tables symmetric in the element
pair are stored as their lower triangle):

``n_ref`` (104,) number of reference systems per element (index = Z, 0 unused);
``ref_cn`` (104, 7) reference coordination numbers (-1 = no reference);
``c6_packed`` reference C6 (Hartree bohr^6) for Z1 >= Z2, refs a < n_ref[Z1],
b < n_ref[Z2], in C order; ``r4r2`` (104,) <r4>/<r2> (a.u.); ``rcov`` (104,)
covalent radii (Å, before the D3 factor 4/3); ``r0ab_packed`` pairwise R0AB
(Å, ``numpy.tril_indices(104)`` order); functional parameters ``functionals``,
``bj`` (s6, s8, a1, a2 [bohr]) and ``zero`` (s6, s8, rs6, rs8), NaN where not
published; ``alias_from`` / ``alias_to`` s-dftd3's alternative names.
"""

from __future__ import annotations

import argparse
import io
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib

MAX_Z = 103  # Lr: the last element of the D3 reference tables
N_ROWS = MAX_Z + 1
OUT = Path(__file__).resolve().parents[1] / "halopipe" / "models" / "data" / "dftd3_reference.npz"


def _read(wheel: zipfile.ZipFile, name: str) -> bytes:
    return wheel.read(name)


def _python_list(source: str, name: str) -> np.ndarray:
    """The numbers of the literal list ``name = [...]`` in a Python source (comments dropped)."""
    start = source.index(f"{name} = [")
    body = source[source.index("[", start) + 1 : source.index("]", start)]
    body = "\n".join(line.split("#", 1)[0] for line in body.splitlines())
    return np.array([float(v) for v in re.findall(r"[-+]?\d+\.\d*", body)], dtype=np.float64)


def reference_cn(source: str) -> np.ndarray:
    """(104, 7) reference coordination numbers from tad-dftd3's ``reference.py``."""
    start = source.index("def _load_cn")
    body = source[start : source.index("def _load_c6")]
    lines = [line for line in body.splitlines() if line.strip().startswith("[") and "#" in line]  # one "[...],  # El" per element
    rows = [re.findall(r"[-+]?\d+\.\d+", line.split("#", 1)[0]) for line in lines]
    table = np.array([[float(v) for v in row] for row in rows], dtype=np.float64)
    assert table.shape == (N_ROWS, 7), table.shape
    return table


def load_tables(tad_dftd3: zipfile.ZipFile, tad_mctc: zipfile.ZipFile) -> dict[str, np.ndarray]:
    cn = reference_cn(_read(tad_dftd3, "tad_dftd3/reference.py").decode())
    c6 = torch.load(io.BytesIO(_read(tad_dftd3, "tad_dftd3/reference-c6.pt")), weights_only=True).numpy().astype(np.float64)
    assert c6.shape == (N_ROWS, N_ROWS, 7, 7)
    assert np.array_equal(c6, c6.transpose(1, 0, 3, 2)), "reference C6 must be symmetric"
    valid = cn >= 0
    n_ref = valid.sum(axis=1)
    # Valid references come first, so a count describes them.
    assert all(valid[z, : n_ref[z]].all() for z in range(N_ROWS))
    z = np.arange(N_ROWS)
    a = np.arange(7)
    lower = z[:, None, None, None] >= z[None, :, None, None]
    keep = lower & (a[None, None, :, None] < n_ref[:, None, None, None]) & (a[None, None, None, :] < n_ref[None, :, None, None])
    outside = np.abs(c6[~keep & lower]).max()
    assert outside == 0.0, "nonzero C6 outside the valid references"

    r4r2 = _python_list(_read(tad_dftd3, "tad_dftd3/data/r4r2.py").decode(), "_r4_over_r2")[:N_ROWS]
    rcov = _python_list(_read(tad_mctc, "tad_mctc/data/radii.py").decode(), "_COV_2009")[:N_ROWS]

    # tad-mctc stores R0AB in bohr (Å * AA2AU, AA2AU = 1e-10 / 5.29177210903e-11 per its units module);
    # the published values are Å with four decimals, which rounding recovers exactly.
    r0_bohr = torch.load(io.BytesIO(_read(tad_mctc, "tad_mctc/data/vdw-pairwise.pt")), weights_only=True).numpy()
    aa2au = 1e-10 / 5.29177210903e-11
    r0 = np.round(r0_bohr / aa2au, 4)
    assert np.abs(r0 * aa2au - r0_bohr).max() < 1e-10, "R0AB did not round back to four decimals"
    assert np.array_equal(r0, r0.T)
    rows, cols = np.tril_indices(N_ROWS)
    return {
        "n_ref": n_ref.astype(np.int64),
        "ref_cn": cn,
        "c6_packed": c6[keep],
        "r4r2": r4r2,
        "rcov": rcov,
        "r0ab_packed": r0[rows, cols],
    }


def _row(entry: dict, keys: tuple[str, ...]) -> list[float]:
    """Parameters in ``keys`` order; NaN for all when one is not given (e.g. cf22d lists no s8)."""
    return [float(entry[k]) for k in keys] if all(k in entry for k in keys) else [np.nan] * len(keys)


def load_functionals(tad_dftd3: zipfile.ZipFile) -> dict[str, np.ndarray]:
    params = tomllib.loads(_read(tad_dftd3, "tad_dftd3/param/parameters.toml").decode())
    aliases = tomllib.loads(_read(tad_dftd3, "tad_dftd3/param/aliases.toml").decode())["alias"]
    defaults = params["default"]["parameter"]["d3"]
    names, bj, zero = [], [], []
    for name, entry in sorted(params["parameter"].items()):
        d3 = entry.get("d3", {})
        if "bj" not in d3 and "zero" not in d3:
            continue
        names.append(name)
        bj.append(_row({**defaults["bj"], **d3["bj"]}, ("s6", "s8", "a1", "a2")) if "bj" in d3 else [np.nan] * 4)
        zero.append(_row({**defaults["zero"], **d3["zero"]}, ("s6", "s8", "rs6", "rs8")) if "zero" in d3 else [np.nan] * 4)
    known = set(names)
    pairs = sorted((k, v) for k, v in aliases.items() if v in known and k.isascii())
    return {
        "functionals": np.array(names),
        "bj": np.array(bj, dtype=np.float64),
        "zero": np.array(zero, dtype=np.float64),
        "alias_from": np.array([k for k, _ in pairs]),
        "alias_to": np.array([v for _, v in pairs]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tad_dftd3_wheel", type=Path)
    parser.add_argument("tad_mctc_wheel", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    with zipfile.ZipFile(args.tad_dftd3_wheel) as d3, zipfile.ZipFile(args.tad_mctc_wheel) as mctc:
        data = {**load_tables(d3, mctc), **load_functionals(d3)}
    data["source"] = np.array(f"Grimme et al. 2010 D3 values via {args.tad_dftd3_wheel.name}, {args.tad_mctc_wheel.name}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **data)
    size = args.out.stat().st_size / 1024
    print(f"wrote {args.out} ({size:.0f} KiB): {len(data['functionals'])} functionals, {data['c6_packed'].size} reference C6")


if __name__ == "__main__":
    main()
