"""Warp sources of the half-list pair kernels (imported only when Warp loads).

A thread takes one pair ``(a, b)`` of a half list, or one owned row ``a``
and its pairs, skips pairs beyond the cutoff, adds half the pair energy to
each end and the pair force, weighted by ``(weight[a] + weight[b]) / 2``, to
both ends with opposite signs (the direct Lennard-Jones kernels differ: see
:func:`_lj_owned_complete`).
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


def _lj_owned_rows(single_type: bool):
    """Lennard-Jones over a half list grouped by owned row: one thread per owned row ``a``.

    The thread walks its pairs ``start[a] .. start[a + 1]``, keeps the force
    and energy of ``a`` in registers and writes them once; only the
    partner ``b`` is updated per pair (Newton's third law). With one pair
    type (``single_type``) the parameters are loaded once per thread instead
    of once per pair. (Accumulating the virial here too measured 20 % slower
    than one matrix product over the rows afterwards.) Forces are
    ``-d(sum_i weight_i e_i)/d(rows)``: each pair's force carries
    ``(weight[a] + weight[b]) / 2``.
    """

    @wp.kernel
    def lj(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        ptype: wp.array(dtype=wp.int32),
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
        fa = wp.vec3d()
        ea = wp.float64(0.0)
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            if r2 <= rc2:  # else a candidate within the skin, not the cutoff
                if not wp.static(single_type):
                    p = params[ptype[k]]
                inv2 = wp.float64(1.0) / r2
                inv6 = inv2 * inv2 * inv2
                half = _lj_half_energy(inv6, p)
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

    ``forces`` (owned rows only) gets each pair's whole force: on ``a`` and,
    by Newton's third law, on an owned partner; a pair with a ghost is
    evaluated by both ranks that hold it, each keeping the force on its own
    atom. The owned forces are computed the same way whatever ``energy`` and
    ``virial`` ask, so a forces-only step moves atoms exactly as a step that
    also reports. ``energy``: owned per-row energies (half of each pair to
    each owned end). ``virial``: the forces of this rank's energy share, where
    a ghost pair counts half: ``rest[a]``, the half of ``a``'s ghost pairs'
    forces to give back, and ``ghost_forces`` (by ghost row), so that
    ``sum_owned r (x) (forces + rest) + sum_ghost r (x) ghost_forces`` is the
    share's virial. Eight compiled variants: a run-time test of the flags in
    the inner loop would cost on every pair.
    """

    @wp.kernel
    def lj(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        ptype: wp.array(dtype=wp.int32),
        params: wp.array(dtype=wp.vec3d),
        n_owned: wp.int32,
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
        rest: wp.array(dtype=wp.vec3d),
        ghost_forces: wp.array(dtype=wp.vec3d),
    ):
        a = wp.tid()
        ra = rows[a]
        p = params[0]  # (a12, b6, shift) of the only pair type, or overwritten per pair
        fa = wp.vec3d()
        rest_a = wp.vec3d()
        ea = wp.float64(0.0)
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            if r2 <= rc2:  # else a candidate within the skin, not the cutoff
                if not wp.static(single_type):
                    p = params[ptype[k]]
                inv2 = wp.float64(1.0) / r2
                inv6 = inv2 * inv2 * inv2
                if wp.static(energy):
                    half = _lj_half_energy(inv6, p)
                    ea += half
                    if b < n_owned:
                        wp.atomic_add(energies, b, half)
                f = _lj_force_over_r(inv2, inv6, p) * d
                fa -= f
                if b < n_owned:
                    wp.atomic_add(forces, b, f)
                elif wp.static(virial):
                    h = wp.float64(0.5) * f
                    wp.atomic_add(ghost_forces, b - n_owned, h)
                    rest_a += h
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


def _d3_bj(ghosts_once: bool):
    """D3(BJ) two-body over a half list, one thread per pair.

    ``ghosts_once``: the list holds each pair with a ghost on one rank only
    (see :func:`halopipe.kernels.dftd3.ghost_pairs_once`), so such a pair's
    whole energy goes to its owned row ``a`` and its force carries ``a``'s
    weight alone (the ghost's force is folded home by the caller).
    """

    @wp.kernel
    def d3_bj(
        rows: wp.array(dtype=wp.vec3d),
        first: wp.array(dtype=wp.int32),
        second: wp.array(dtype=wp.int32),
        species: wp.array(dtype=wp.int32),
        ref_weights: wp.array2d(dtype=wp.float64),
        c6ref: wp.array(dtype=wp.float64),
        c8_over_c6: wp.array(dtype=wp.float64),
        r0_6: wp.array(dtype=wp.float64),
        r0_8: wp.array(dtype=wp.float64),
        n_species: wp.int32,
        n_ref: wp.int32,
        s6: wp.float64,
        s8: wp.float64,
        weight: wp.array(dtype=wp.float64),
        n_owned: wp.int32,
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
        weight_grad: wp.array2d(dtype=wp.float64),
    ):
        k = wp.tid()
        a = first[k]
        b = second[k]
        d = rows[b] - rows[a]
        r2 = wp.dot(d, d)
        if r2 > rc2:
            return
        p = species[a] * n_species + species[b]
        base = p * n_ref * n_ref
        c6 = wp.float64(0.0)
        for i in range(n_ref):
            wa = ref_weights[a, i]
            for j in range(n_ref):
                c6 += wa * c6ref[base + i * n_ref + j] * ref_weights[b, j]
        r6 = r2 * r2 * r2
        r8 = r6 * r2
        e6 = wp.float64(1.0) / (r6 + r0_6[p])
        e8 = wp.float64(1.0) / (r8 + r0_8[p])
        qq = c8_over_c6[p]
        # BJ: u = -(s6 C6 / (r^6 + R0^6) + s8 C8 / (r^8 + R0^8)), C8 = qq C6.
        per_c6 = -(s6 * e6 + s8 * qq * e8)
        half = wp.float64(0.5) * c6 * per_c6
        c = wp.float64(0.5) * (weight[a] + weight[b])
        if wp.static(ghosts_once):
            if b >= n_owned:  # the ghost's owner does not hold this pair: all of it is a's
                c = weight[a]
                half = wp.float64(2.0) * half
                wp.atomic_add(energies, a, half)
            else:
                wp.atomic_add(energies, a, half)
                wp.atomic_add(energies, b, half)
        else:
            wp.atomic_add(energies, a, half)
            wp.atomic_add(energies, b, half)
        du_dr2 = c6 * (wp.float64(3.0) * s6 * r2 * r2 * e6 * e6 + wp.float64(4.0) * s8 * qq * r6 * e8 * e8)
        f = (wp.float64(-2.0) * c * du_dr2) * d
        wp.atomic_add(forces, b, f)
        wp.atomic_sub(forces, a, f)
        # dE/dw through C6 = w_a^T C6ref w_b.
        g = c * per_c6
        for i in range(n_ref):
            row = wp.float64(0.0)
            col = wp.float64(0.0)
            for j in range(n_ref):
                row += c6ref[base + i * n_ref + j] * ref_weights[b, j]
                col += ref_weights[a, j] * c6ref[base + j * n_ref + i]
            wp.atomic_add(weight_grad, a, i, g * row)
            wp.atomic_add(weight_grad, b, i, g * col)

    return d3_bj


d3_bj_half_list = _d3_bj(ghosts_once=False)
d3_bj_ghosts_once = _d3_bj(ghosts_once=True)


@wp.func
def _cn_count(r2: wp.float64, rcov_sum: wp.float64, k1: wp.float64):
    """D3 counting function 1 / (1 + exp(-k1 (rcov_sum / r - 1))) as a sigmoid."""
    return wp.float64(1.0) / (wp.float64(1.0) + wp.exp(-k1 * (rcov_sum / wp.sqrt(r2) - wp.float64(1.0))))


@wp.kernel
def d3_cn_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rcov: wp.array(dtype=wp.float64),
    k1: wp.float64,
    rc2: wp.float64,
    cn: wp.array(dtype=wp.float64),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc2:
        return
    count = _cn_count(r2, rcov[a] + rcov[b], k1)
    wp.atomic_add(cn, a, count)
    wp.atomic_add(cn, b, count)


@wp.kernel
def d3_cn_backward_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rcov: wp.array(dtype=wp.float64),
    k1: wp.float64,
    rc2: wp.float64,
    cn_grad: wp.array(dtype=wp.float64),
    rows_grad: wp.array(dtype=wp.vec3d),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc2:
        return
    rcov_sum = rcov[a] + rcov[b]
    count = _cn_count(r2, rcov_sum, k1)
    r = wp.sqrt(r2)
    # d count / d r = count (1 - count) k1 (-rcov_sum / r^2); d r / d r_b = d / r.
    dcount = count * (wp.float64(1.0) - count) * k1 * (-rcov_sum / r2)
    g = (cn_grad[a] + cn_grad[b]) * dcount / r * d
    wp.atomic_add(rows_grad, b, g)
    wp.atomic_sub(rows_grad, a, g)
