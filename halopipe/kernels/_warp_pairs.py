"""Warp sources of the half-list pair kernels (imported only when Warp loads).

Each thread takes one pair ``(a, b)`` of a half list, skips it beyond the
cutoff, adds half the pair energy to each end and the pair force, weighted by
``(weight[a] + weight[b]) / 2``, to both ends with opposite signs.
"""

from __future__ import annotations

import warp as wp

# Backward passes are written by hand (the autograd Functions); skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})


@wp.kernel
def lj_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    ptype: wp.array(dtype=wp.int32),
    a12: wp.array(dtype=wp.float64),
    b6: wp.array(dtype=wp.float64),
    shift: wp.array(dtype=wp.float64),
    weight: wp.array(dtype=wp.float64),
    rc2: wp.float64,
    energies: wp.array(dtype=wp.float64),
    forces: wp.array(dtype=wp.vec3d),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc2:  # a candidate within the skin, not the cutoff
        return
    t = ptype[k]
    inv2 = wp.float64(1.0) / r2
    inv6 = inv2 * inv2 * inv2
    half = wp.float64(0.5) * ((a12[t] * inv6 - b6[t]) * inv6 - shift[t])
    wp.atomic_add(energies, a, half)
    wp.atomic_add(energies, b, half)
    c = wp.float64(0.5) * (weight[a] + weight[b])
    f = (c * (wp.float64(12.0) * a12[t] * inv6 - wp.float64(6.0) * b6[t]) * inv6 * inv2) * d
    wp.atomic_add(forces, b, f)
    wp.atomic_sub(forces, a, f)


@wp.kernel
def ewald_real_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    charges: wp.array(dtype=wp.float64),
    weight: wp.array(dtype=wp.float64),
    rc2: wp.float64,
    alpha: wp.float64,
    coulomb: wp.float64,
    energies: wp.array(dtype=wp.float64),
    forces: wp.array(dtype=wp.vec3d),
    charge_grad: wp.array(dtype=wp.float64),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc2:
        return
    r = wp.sqrt(r2)
    screened = coulomb * wp.erfc(alpha * r) / r  # k_e erfc(alpha r) / r
    qa = charges[a]
    qb = charges[b]
    half = wp.float64(0.5) * qa * qb * screened
    wp.atomic_add(energies, a, half)
    wp.atomic_add(energies, b, half)
    c = wp.float64(0.5) * (weight[a] + weight[b])
    wp.atomic_add(charge_grad, a, c * qb * screened)
    wp.atomic_add(charge_grad, b, c * qa * screened)
    # -du/dr / r with u = q_a q_b k_e erfc(alpha r) / r
    gauss = coulomb * wp.float64(1.1283791670955126) * alpha * wp.exp(-alpha * alpha * r2)  # k_e 2 alpha / sqrt(pi) exp(-alpha^2 r^2)
    f = (c * qa * qb * (screened + gauss) / r2) * d
    wp.atomic_add(forces, b, f)
    wp.atomic_sub(forces, a, f)
