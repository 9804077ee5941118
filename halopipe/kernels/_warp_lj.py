"""Warp source of the Lennard-Jones half-list kernel (imported only when Warp loads)."""

from __future__ import annotations

import warp as wp


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
