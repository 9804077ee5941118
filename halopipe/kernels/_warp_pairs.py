"""Warp sources of the half-list pair kernels (imported only when Warp loads).

A thread takes one owned row ``a`` and its pairs, masks candidates beyond
the cutoff, adds half the pair energy to each end and the pair force,
weighted by ``(weight[a] + weight[b]) / 2``, to both ends with opposite
signs (the direct Lennard-Jones kernels differ: see :func:`_lj_owned_complete`).
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
def _masked_inv2(inside: bool, r2: wp.float64):
    """``1 / r^2`` inside the cutoff, 0 for a candidate within the skin (which then adds exact zeros).

    A select, not a branch: about a third of a list's candidates lie in the
    skin, in no order a branch predictor can learn, and the mispredictions
    cost more than the masked arithmetic (LJ 32k: 25-30 % of the kernel).
    """
    return wp.where(inside, wp.float64(1.0) / r2, wp.float64(0.0))


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
    not branched over (see :func:`_masked_inv2`).
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
            inside = r2 <= rc2
            if not wp.static(single_type):
                p = params[type_a + row_type[b]]
            inv2 = _masked_inv2(inside, r2)
            inv6 = inv2 * inv2 * inv2
            half = wp.where(inside, _lj_half_energy(inv6, p), wp.float64(0.0))
            ea += half
            wp.atomic_add(energies, b, half)
            c = wp.float64(0.5) * (wa + weight[b])
            f = (c * _lj_force_over_r(inv2, inv6, p)) * d
            wp.atomic_add(forces, b, f)
            fa -= f
        wp.atomic_add(energies, a, ea)
        wp.atomic_add(forces, a, fa)

    return lj


def _lj_owned_complete(single_type: bool, energy: bool, virial: bool):
    """Lennard-Jones direct forces, complete on the owned rows (LAMMPS's ``newton off``): one thread per owned row ``a``.

    ``forces`` (every row) gets each pair's whole force on both ends: on an
    owned row that is its complete force (a pair with a ghost is evaluated
    by both ranks that hold it, each keeping the force on its own atom); a
    ghost row's sum is left for the caller, who keeps half of it for the
    virial or drops it. Writing every row rather than testing ``b < n_owned``
    costs no branch. The owned forces are computed the same way whatever
    ``energy`` and ``virial`` ask, so a forces-only step moves atoms exactly
    as a step that also reports. ``energy``: per-row energies (half of each
    pair to each end; the owned rows' are the owned energies). ``virial``:
    ``rest[a]``, the half of ``a``'s ghost pairs' forces that this rank's
    energy share gives back, so that ``sum_owned r (x) (forces + rest) +
    sum_ghost r (x) forces / 2`` is the share's virial. Eight compiled
    variants: a run-time test of the flags in the inner loop would cost on
    every pair.
    """

    @wp.kernel
    def lj(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        row_type: wp.array(dtype=wp.int32),
        n_types: wp.int32,
        params: wp.array(dtype=wp.vec3d),
        n_owned: wp.int32,
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
        rest: wp.array(dtype=wp.vec3d),
    ):
        a = wp.tid()
        ra = rows[a]
        p = params[0]  # (a12, b6, shift) of the only pair type, or overwritten per pair
        type_a = wp.int32(0)
        if not wp.static(single_type):
            type_a = row_type[a] * n_types
        fa = wp.vec3d()
        rest_a = wp.vec3d()
        ea = wp.float64(0.0)
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            inside = r2 <= rc2
            if not wp.static(single_type):
                p = params[type_a + row_type[b]]
            inv2 = _masked_inv2(inside, r2)
            inv6 = inv2 * inv2 * inv2
            if wp.static(energy):
                half = wp.where(inside, _lj_half_energy(inv6, p), wp.float64(0.0))
                ea += half
                wp.atomic_add(energies, b, half)
            f = _lj_force_over_r(inv2, inv6, p) * d
            fa -= f
            wp.atomic_add(forces, b, f)
            if wp.static(virial):
                rest_a += wp.where(b < n_owned, wp.vec3d(), wp.float64(0.5) * f)
        wp.atomic_add(forces, a, fa)
        if wp.static(energy):
            wp.atomic_add(energies, a, ea)
        if wp.static(virial):
            rest[a] = rest_a

    return lj


lj_owned_rows = _lj_owned_rows(single_type=False)
lj_owned_rows_single_type = _lj_owned_rows(single_type=True)
LJ_COMPLETE = {
    (single, energy, virial): _lj_owned_complete(single, energy, virial)
    for single in (False, True)
    for energy in (False, True)
    for virial in (False, True)
}
"""The complete (direct) kernels by ``(single_type, energy, virial)``."""
