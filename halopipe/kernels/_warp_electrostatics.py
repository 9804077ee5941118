"""Warp sources of the charge kernels (imported only when Warp loads): damped Coulomb pairs and coordination numbers.

Conventions as in :mod:`._warp_pairs`: one thread per row ``a`` of a list
grouped by row, its own terms summed in registers, candidates beyond the
cutoff skipped, pair terms added to both ends.
"""

from __future__ import annotations

import warp as wp

# Backward passes are written by hand (the autograd Functions); skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})

# W. J. Cody's rational Chebyshev approximations of erf/erfc (Math. Comp. 23, 631, 1969), double-precision sets:
# erf on [0, 0.46875] (A/B in x^2), erfc(x) exp(x^2) on (0.46875, 4] (C/D in x) and on (4, inf) (P/Q in 1/x^2).
_ERF_A = (3.16112374387056560e0, 1.13864154151050156e2, 3.77485237685302021e2, 3.20937758913846947e3, 1.85777706184603153e-1)
_ERF_B = (2.36012909523441209e1, 2.44024637934444173e2, 1.28261652607737228e3, 2.84423683343917062e3)
_ERFC_C = (
    5.64188496988670089e-1,
    8.88314979438837594e0,
    6.61191906371416295e1,
    2.98635138197400131e2,
    8.81952221241769090e2,
    1.71204761263407058e3,
    2.05107837782607147e3,
    1.23033935479799725e3,
    2.15311535474403846e-8,
)
_ERFC_D = (
    1.57449261107098347e1,
    1.17693950891312499e2,
    5.37181101862009858e2,
    1.62138957456669019e3,
    3.29079923573345963e3,
    4.36261909014324716e3,
    3.43936767414372164e3,
    1.23033935480374942e3,
)
_ERFC_P = (
    3.05326634961232344e-1,
    3.60344899949804439e-1,
    1.25781726111229246e-1,
    1.60837851487422766e-2,
    6.58749161529837803e-4,
    1.63153871373020978e-2,
)
_ERFC_Q = (2.56852019228982242e0, 1.87295284992346047e0, 5.27905102951428412e-1, 6.05183413124413191e-2, 2.33520497626869185e-3)


@wp.func
def _ratio(num: wp.float64, den: wp.float64, z: wp.float64, c: wp.float64, d: wp.float64):
    """One Horner step of a numerator and a denominator, returned as a pair."""
    return (num + c) * z, (den + d) * z


@wp.func
def erfc_given_gauss(x: wp.float64, gauss: wp.float64) -> wp.float64:
    """``erfc(x)`` for ``x >= 0``, given ``gauss = exp(-x^2)``, which the pair force needs anyway.

    libm's erfc computes its own exponentials (two, for most pair distances);
    sharing the force's makes erfc a rational function (~1e-15 relative).
    """
    if x < wp.float64(0.46875):
        z = x * x
        num, den = _ratio(wp.float64(wp.static(_ERF_A[4])) * z, z, z, wp.float64(wp.static(_ERF_A[0])), wp.float64(wp.static(_ERF_B[0])))
        num, den = _ratio(num, den, z, wp.float64(wp.static(_ERF_A[1])), wp.float64(wp.static(_ERF_B[1])))
        num, den = _ratio(num, den, z, wp.float64(wp.static(_ERF_A[2])), wp.float64(wp.static(_ERF_B[2])))
        return wp.float64(1.0) - x * (num + wp.float64(wp.static(_ERF_A[3]))) / (den + wp.float64(wp.static(_ERF_B[3])))
    if x <= wp.float64(4.0):
        num, den = _ratio(wp.float64(wp.static(_ERFC_C[8])) * x, x, x, wp.float64(wp.static(_ERFC_C[0])), wp.float64(wp.static(_ERFC_D[0])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[1])), wp.float64(wp.static(_ERFC_D[1])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[2])), wp.float64(wp.static(_ERFC_D[2])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[3])), wp.float64(wp.static(_ERFC_D[3])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[4])), wp.float64(wp.static(_ERFC_D[4])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[5])), wp.float64(wp.static(_ERFC_D[5])))
        num, den = _ratio(num, den, x, wp.float64(wp.static(_ERFC_C[6])), wp.float64(wp.static(_ERFC_D[6])))
        return gauss * (num + wp.float64(wp.static(_ERFC_C[7]))) / (den + wp.float64(wp.static(_ERFC_D[7])))
    z = wp.float64(1.0) / (x * x)
    num, den = _ratio(wp.float64(wp.static(_ERFC_P[5])) * z, z, z, wp.float64(wp.static(_ERFC_P[0])), wp.float64(wp.static(_ERFC_Q[0])))
    num, den = _ratio(num, den, z, wp.float64(wp.static(_ERFC_P[1])), wp.float64(wp.static(_ERFC_Q[1])))
    num, den = _ratio(num, den, z, wp.float64(wp.static(_ERFC_P[2])), wp.float64(wp.static(_ERFC_Q[2])))
    num, den = _ratio(num, den, z, wp.float64(wp.static(_ERFC_P[3])), wp.float64(wp.static(_ERFC_Q[3])))
    tail = z * (num + wp.float64(wp.static(_ERFC_P[4]))) / (den + wp.float64(wp.static(_ERFC_Q[4])))
    return gauss * (wp.float64(0.5641895835477563) - tail) / x


@wp.func
def _damped_pair(r2: wp.float64, rc: wp.float64, alpha: wp.float64, coulomb: wp.float64, k_shift: wp.float64, k_slope: wp.float64):
    """``(u, -du/dr / r)`` over ``q_a q_b`` of a pair within the cutoff, at squared distance ``r2``."""
    r = wp.sqrt(r2)
    inv_r = wp.float64(1.0) / r  # one division for the three quotients by r
    exp_ar2 = wp.exp(-alpha * alpha * r2)
    screened = coulomb * erfc_given_gauss(alpha * r, exp_ar2) * inv_r  # k_e erfc(alpha r) / r
    pair = screened - k_shift + k_slope * (r - rc)  # Ewald's real space has no shift or slope
    # -du/dr / r = ((screened + gauss) / r - k_slope) / r, gauss = k_e 2 alpha / sqrt(pi) exp(-alpha^2 r^2)
    gauss = coulomb * wp.float64(1.1283791670955126) * alpha * exp_ar2
    return wp.vec2d(pair, ((screened + gauss) * inv_r - k_slope) * inv_r)


def _damped_coulomb_rows(charge_gradients: bool):
    """Damped Coulomb pairs of a list grouped by row: one thread per row ``a``, its own terms summed in registers.

    Row ``a``'s pairs are ``second[start[a] .. start[a + 1]]``; the partner
    ends get their terms by atomic adds. With or without ``dE/dq`` (fixed
    charges need none: one atomic add a pair less). A thread per pair, which
    reads ``first`` and writes both ends of every pair, measured 5-9 % slower
    on the demo composite's 780,000 pairs.
    """

    @wp.kernel
    def damped_coulomb_rows(
        rows: wp.array(dtype=wp.vec3d),
        start: wp.array(dtype=wp.int32),
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
        a = wp.tid()
        ra = rows[a]
        qa = charges[a]
        wa = weight[a]
        ea = wp.float64(0.0)
        ga = wp.float64(0.0)
        fa = wp.vec3d()
        rc2 = rc * rc
        for k in range(start[a], start[a + 1]):
            b = second[k]
            d = rows[b] - ra
            r2 = wp.dot(d, d)
            if r2 <= rc2:  # else a candidate within the skin, not the cutoff
                terms = _damped_pair(r2, rc, alpha, coulomb, k_shift, k_slope)
                qb = charges[b]
                half = wp.float64(0.5) * qa * qb * terms[0]
                ea += half
                wp.atomic_add(energies, b, half)
                c = wp.float64(0.5) * (wa + weight[b])
                if wp.static(charge_gradients):
                    ga += c * qb * terms[0]
                    wp.atomic_add(charge_grad, b, c * qa * terms[0])
                f = (c * qa * qb * terms[1]) * d
                wp.atomic_add(forces, b, f)
                fa -= f
        wp.atomic_add(energies, a, ea)
        wp.atomic_add(forces, a, fa)
        if wp.static(charge_gradients):
            wp.atomic_add(charge_grad, a, ga)

    return damped_coulomb_rows


damped_coulomb_grouped = _damped_coulomb_rows(charge_gradients=True)
damped_coulomb_grouped_fixed_charges = _damped_coulomb_rows(charge_gradients=False)


@wp.kernel
def cosine_coordination_rows(
    rows: wp.array(dtype=wp.vec3d),
    start: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rc: wp.float64,
    cn: wp.array(dtype=wp.float64),
):
    """Cosine-cutoff counts of a half list grouped by row: one thread per row ``a``, its own count summed in registers.

    As the damped Coulomb kernel: a thread per pair (reading ``first`` and
    adding to both ends) measured 2.2 against 2.0 ms a step on the demo
    composite's 102,000 pairs at 5 Å (one rank), its backward 2.6 against
    2.6 ms. Most of the time is the cosine (or sine) of the half of the
    candidates within the cutoff, about 40 ns each here.
    """
    a = wp.tid()
    ra = rows[a]
    rc2 = rc * rc
    ca = wp.float64(0.0)
    for k in range(start[a], start[a + 1]):
        b = second[k]
        d = rows[b] - ra
        r2 = wp.dot(d, d)
        if r2 <= rc2:  # else a candidate within the skin (about half of them at 4 Å): the cosine is worth a branch
            count = wp.float64(0.5) * (wp.float64(1.0) + wp.cos(wp.float64(3.141592653589793) * wp.sqrt(r2) / rc))
            ca += count
            wp.atomic_add(cn, b, count)
    wp.atomic_add(cn, a, ca)


@wp.kernel
def cosine_coordination_backward_rows(
    rows: wp.array(dtype=wp.vec3d),
    start: wp.array(dtype=wp.int32),
    second: wp.array(dtype=wp.int32),
    rc: wp.float64,
    cn_grad: wp.array(dtype=wp.float64),
    rows_grad: wp.array(dtype=wp.vec3d),
):
    """The gradient of ``sum_a cn_grad_a CN_a`` to the rows, one thread per row as :data:`cosine_coordination_rows`."""
    a = wp.tid()
    ra = rows[a]
    ga = cn_grad[a]
    rc2 = rc * rc
    w = wp.float64(3.141592653589793) / rc
    fa = wp.vec3d()
    for k in range(start[a], start[a + 1]):
        b = second[k]
        d = rows[b] - ra
        r2 = wp.dot(d, d)
        if r2 <= rc2:
            r = wp.sqrt(r2)
            # d count / d r = -(pi / 2 r_c) sin(pi r / r_c); d r / d r_b = d / r.
            g = ((ga + cn_grad[b]) * wp.float64(-0.5) * w * wp.sin(w * r) / r) * d
            wp.atomic_add(rows_grad, b, g)
            fa -= g
    wp.atomic_add(rows_grad, a, fa)
