"""Warp sources of the half-list pair kernels (imported only when Warp loads).

A thread takes one owned row ``a`` and its pairs, masks candidates beyond
the cutoff, adds half the pair energy to each end and the pair force,
weighted by ``(weight[a] + weight[b]) / 2``, to both ends with opposite
signs (the direct Lennard-Jones kernels differ: see :func:`_lj_direct`).
"""

from __future__ import annotations

import warp as wp

# Backward passes are written by hand (the autograd Functions); skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})


@wp.func
def _lj_half_energy(inv6: wp.float64, p: wp.vec3d):
    """Half the pair energy ``(a12 / r^12 - b6 / r^6 - shift) / 2`` from ``inv6 = 1 / r^6`` and ``p = (a12, b6, shift)``."""
    return wp.float64(0.5) * ((p[0] * inv6 - p[1]) * inv6 - p[2])


@wp.func
def _lj_force_over_r(inv2: wp.float64, inv6: wp.float64, p: wp.vec3d):
    """``-(du/dr) / r``: the pair force on the partner is this times ``r_b - r_a``."""
    return (wp.float64(12.0) * p[0] * inv6 - wp.float64(6.0) * p[1]) * inv6 * inv2


@wp.func
def _inside(r2: wp.float64, rc2: wp.float64):
    """1 for a pair within the cutoff, 0 for a candidate in the skin: a factor for ``1 / r^2`` and the energy.

    Multiplied in, never branched on: about a third of a list's candidates
    lie in the skin, in no order a branch predictor can learn, and the
    mispredictions cost more than the masked arithmetic (LJ 32k: 25-30 % of
    the kernel). Written as ``where(inside, 1 / r2, 0)``, the C++ compiler
    put a branch around the division in the forces-only kernel, which ran
    1.9x longer in an MD step (12.5 against 6.5 ms, LJ 32k, one rank).
    ``0 / r2`` is an exact zero (a candidate in the skin lies at
    ``r2 > rc2 > 0``), and so is the masked energy.
    """
    return wp.where(r2 <= rc2, wp.float64(1.0), wp.float64(0.0))


def _lj_owned_rows(single_type: bool):
    """Lennard-Jones over a half list grouped by owned row: one thread per owned row ``a``.

    The thread walks its pairs ``start[a] .. start[a + 1]``, keeps the force
    and energy of ``a`` in registers and writes them once; only the
    partner ``b`` is updated per pair (Newton's third law). With one pair
    type (``single_type``) the parameters are loaded once per thread instead
    of once per pair; with several, a pair's are ``params[row_type[a] *
    n_types + row_type[b]]`` (types per row: nothing per pair to make at a
    rebuild). (Accumulating the virial here too measured 20 % slower
    than one matrix product over the rows afterwards.) Forces are
    ``-d(sum_i weight_i e_i)/d(rows)``: each pair's force carries
    ``(weight[a] + weight[b]) / 2``. Candidates beyond the cutoff are masked,
    not branched over (see :func:`_inside`).
    """

    @wp.kernel
    def lj(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        row_type: wp.array(dtype=wp.int32),
        n_types: wp.int32,
        params: wp.array(dtype=wp.vec3d),
        weight: wp.array(dtype=wp.float64),
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
    ):
        a = wp.tid()
        ra = rows[a]
        wa = weight[a]
        p = params[0]  # (a12, b6, shift) of the only pair type, or overwritten per pair
        type_a = wp.int32(0)
        if not wp.static(single_type):
            type_a = row_type[a] * n_types
        fa = wp.vec3d()
        ea = wp.float64(0.0)
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            inside = _inside(r2, rc2)
            if not wp.static(single_type):
                p = params[type_a + row_type[b]]
            inv2 = inside / r2
            inv6 = inv2 * inv2 * inv2
            half = inside * _lj_half_energy(inv6, p)
            ea += half
            wp.atomic_add(energies, b, half)
            c = wp.float64(0.5) * (wa + weight[b])
            f = (c * _lj_force_over_r(inv2, inv6, p)) * d
            wp.atomic_add(forces, b, f)
            fa -= f
        wp.atomic_add(energies, a, ea)
        wp.atomic_add(forces, a, fa)

    return lj


def _lj_direct(single_type: bool, energy: bool):
    """Lennard-Jones direct forces and energies on every row: one thread per owned row ``a``.

    Each listed pair's whole force goes to both ends (a ghost end's share is
    for its owner: the caller folds ghost rows home), so over a one-holder
    list (each pair of the system listed once, LAMMPS's ``newton on``) the
    rows' forces sum to the complete forces. Writing every row rather than
    testing ``b < n_owned`` costs no branch. The forces are computed the
    same way whether or not ``energy`` asks for per-row energies (half of
    each pair to each end), so a forces-only step moves atoms exactly as a
    step that also reports. Four compiled variants: a run-time test of the
    flag in the inner loop would cost on every pair.
    """

    @wp.kernel
    def lj(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        row_type: wp.array(dtype=wp.int32),
        n_types: wp.int32,
        params: wp.array(dtype=wp.vec3d),
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
    ):
        a = wp.tid()
        ra = rows[a]
        p = params[0]  # (a12, b6, shift) of the only pair type, or overwritten per pair
        type_a = wp.int32(0)
        if not wp.static(single_type):
            type_a = row_type[a] * n_types
        fa = wp.vec3d()
        ea = wp.float64(0.0)
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            inside = _inside(r2, rc2)
            if not wp.static(single_type):
                p = params[type_a + row_type[b]]
            inv2 = inside / r2
            inv6 = inv2 * inv2 * inv2
            if wp.static(energy):
                half = inside * _lj_half_energy(inv6, p)
                ea += half
                wp.atomic_add(energies, b, half)
            f = _lj_force_over_r(inv2, inv6, p) * d
            fa -= f
            wp.atomic_add(forces, b, f)
        wp.atomic_add(forces, a, fa)
        if wp.static(energy):
            wp.atomic_add(energies, a, ea)

    return lj


lj_owned_rows = _lj_owned_rows(single_type=False)
lj_owned_rows_single_type = _lj_owned_rows(single_type=True)
LJ_DIRECT = {(single, energy): _lj_direct(single, energy) for single in (False, True) for energy in (False, True)}
"""The direct kernels by ``(single_type, energy)``."""
