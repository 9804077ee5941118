"""Warp sources of the charge kernels (imported only when Warp loads): damped Coulomb pairs and coordination numbers.

Conventions as in :mod:`._warp_pairs`: one thread per pair ``(a, b)`` of a
half list, candidates beyond the cutoff skipped, pair terms added to both ends.
"""

from __future__ import annotations

import warp as wp

# Backward passes are written by hand (the autograd Functions); skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})


@wp.kernel
def damped_coulomb_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    charges: wp.array(dtype=wp.float64),
    weight: wp.array(dtype=wp.float64),
    rc: wp.float64,
    alpha: wp.float64,
    coulomb: wp.float64,
    k_shift: wp.float64,
    k_slope: wp.float64,
    energies: wp.array(dtype=wp.float64),
    forces: wp.array(dtype=wp.vec3d),
    charge_grad: wp.array(dtype=wp.float64),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc * rc:  # a candidate within the skin, not the cutoff
        return
    r = wp.sqrt(r2)
    screened = coulomb * wp.erfc(alpha * r) / r  # k_e erfc(alpha r) / r
    pair = screened - k_shift + k_slope * (r - rc)  # u / (q_a q_b); Ewald's real space has no shift or slope
    qa = charges[a]
    qb = charges[b]
    half = wp.float64(0.5) * qa * qb * pair
    wp.atomic_add(energies, a, half)
    wp.atomic_add(energies, b, half)
    c = wp.float64(0.5) * (weight[a] + weight[b])
    wp.atomic_add(charge_grad, a, c * qb * pair)
    wp.atomic_add(charge_grad, b, c * qa * pair)
    # -du/dr / r = q_a q_b ((screened + gauss) / r^2 - k_slope / r), gauss = k_e 2 alpha / sqrt(pi) exp(-alpha^2 r^2)
    gauss = coulomb * wp.float64(1.1283791670955126) * alpha * wp.exp(-alpha * alpha * r2)
    f = (c * qa * qb * ((screened + gauss) / r2 - k_slope / r)) * d
    wp.atomic_add(forces, b, f)
    wp.atomic_sub(forces, a, f)


@wp.kernel
def cosine_coordination_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rc: wp.float64,
    cn: wp.array(dtype=wp.float64),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc * rc:
        return
    count = wp.float64(0.5) * (wp.float64(1.0) + wp.cos(wp.float64(3.141592653589793) * wp.sqrt(r2) / rc))
    wp.atomic_add(cn, a, count)
    wp.atomic_add(cn, b, count)


@wp.kernel
def cosine_coordination_backward_half_list(
    rows: wp.array(dtype=wp.vec3d),
    first: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rc: wp.float64,
    cn_grad: wp.array(dtype=wp.float64),
    rows_grad: wp.array(dtype=wp.vec3d),
):
    k = wp.tid()
    a = first[k]
    b = second[k]
    d = rows[b] - rows[a]
    r2 = wp.dot(d, d)
    if r2 > rc * rc:
        return
    r = wp.sqrt(r2)
    w = wp.float64(3.141592653589793) / rc
    # d count / d r = -(pi / 2 r_c) sin(pi r / r_c); d r / d r_b = d / r.
    g = ((cn_grad[a] + cn_grad[b]) * wp.float64(-0.5) * w * wp.sin(w * r) / r) * d
    wp.atomic_add(rows_grad, b, g)
    wp.atomic_sub(rows_grad, a, g)
