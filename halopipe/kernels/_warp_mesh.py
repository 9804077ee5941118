"""Warp sources of the B-spline mesh kernels (imported only when Warp loads).

One thread per atom. Per axis the thread computes the ``order`` weights of
its support points (and their derivatives) by the cardinal B-spline
recursion, then visits the ``order**3`` points of its box: ``spread`` adds
``q W`` there (atomic adds: atoms share points), ``gather`` sums ``W m`` and
``(dW/du) m`` of the mesh values ``m``. :func:`mesh_kernels` builds one pair
of kernels per order, so that the loops over support points unroll
(``wp.static``; twice as fast as a runtime order on the CPU).
"""

from __future__ import annotations

import functools

import warp as wp

# Backward passes are written by hand (the autograd Functions); skipping Warp's adjoints halves build time.
wp.set_module_options({"enable_backward": False})

MAX_ORDER = 6
vec_order = wp.types.vector(length=MAX_ORDER, dtype=wp.float64)
ivec_order = wp.types.vector(length=MAX_ORDER, dtype=wp.int32)


@wp.func
def bspline_weights(f: wp.float64, order: wp.int32):
    """``c[k] = M_order(f + k)`` and ``d[k] = M_order'(f + k)`` for ``k < order``, ``0 <= f < 1``.

    ``M_n(x) = (x M_{n-1}(x) + (n - x) M_{n-1}(x - 1)) / (n - 1)`` from
    ``M_1 = 1`` on ``[0, 1)``, updated in place from the top so that
    ``c[k - 1]`` is still ``M_{n-1}``; ``M_n' = M_{n-1}(x) - M_{n-1}(x - 1)``.
    """
    c = vec_order()
    d = vec_order()
    c[0] = wp.float64(1.0)
    for n in range(2, order + 1):
        if n == order:
            for k in range(n):
                below = wp.float64(0.0)
                if k > 0:
                    below = c[k - 1]
                d[k] = c[k] - below
        for step in range(n):
            k = n - 1 - step
            below = wp.float64(0.0)
            if k > 0:
                below = c[k - 1]
            x = f + wp.float64(k)
            c[k] = (x * c[k] + (wp.float64(n) - x) * below) / wp.float64(n - 1)
    return c, d


@functools.cache
def mesh_kernels(order: int):
    """``(spread, gather)`` for B-splines of ``order`` (a compile-time constant of the pair)."""
    half_order = wp.float64(0.5 * order)
    last = order - 1

    @wp.func
    def axis_support(u: wp.float64, first: wp.int32, n: wp.int32, lo: wp.int32):
        """Weights, derivatives and box indices of the support points ``first + j`` along one axis (needs ``order <= n``)."""
        # The point first + j sits at u - first - j from the atom; its weight is M_p(f + p - 1 - j).
        f = u + half_order - wp.float64(first + last)
        c, d = bspline_weights(f, order)
        w = vec_order()
        dw = vec_order()
        index = ivec_order()
        start = ((first - lo) % n + n) % n
        for j in range(wp.static(order)):
            w[j] = c[last - j]
            dw[j] = d[last - j]
            g = start + j
            if g >= n:
                g = g - n
            index[j] = g
        return w, dw, index

    @wp.kernel(module="unique")
    def spread(
        u: wp.array(dtype=wp.vec3d),
        first: wp.array(dtype=wp.vec3i),
        q: wp.array(dtype=wp.float64),
        sizes: wp.vec3i,
        lo: wp.vec3i,
        extent: wp.vec3i,
        box: wp.array(dtype=wp.float64),
    ):
        i = wp.tid()
        ui = u[i]
        fi = first[i]
        w0, dw0, i0 = axis_support(ui[0], fi[0], sizes[0], lo[0])
        w1, dw1, i1 = axis_support(ui[1], fi[1], sizes[1], lo[1])
        w2, dw2, i2 = axis_support(ui[2], fi[2], sizes[2], lo[2])
        qi = q[i]
        for a in range(wp.static(order)):
            qa = qi * w0[a]
            for b in range(wp.static(order)):
                qab = qa * w1[b]
                row = (i0[a] * extent[1] + i1[b]) * extent[2]
                for c in range(wp.static(order)):
                    wp.atomic_add(box, row + i2[c], qab * w2[c])

    @wp.kernel(module="unique")
    def gather(
        u: wp.array(dtype=wp.vec3d),
        first: wp.array(dtype=wp.vec3i),
        box: wp.array(dtype=wp.float64),
        sizes: wp.vec3i,
        lo: wp.vec3i,
        extent: wp.vec3i,
        values: wp.array(dtype=wp.float64),
        gradients: wp.array(dtype=wp.vec3d),
    ):
        i = wp.tid()
        ui = u[i]
        fi = first[i]
        w0, dw0, i0 = axis_support(ui[0], fi[0], sizes[0], lo[0])
        w1, dw1, i1 = axis_support(ui[1], fi[1], sizes[1], lo[1])
        w2, dw2, i2 = axis_support(ui[2], fi[2], sizes[2], lo[2])
        value = wp.float64(0.0)
        g0 = wp.float64(0.0)
        g1 = wp.float64(0.0)
        g2 = wp.float64(0.0)
        for a in range(wp.static(order)):
            for b in range(wp.static(order)):
                row = (i0[a] * extent[1] + i1[b]) * extent[2]
                # sum_c W2 m and sum_c W2' m along the last axis, then weighted by the first two axes
                s = wp.float64(0.0)
                ds = wp.float64(0.0)
                for c in range(wp.static(order)):
                    m = box[row + i2[c]]
                    s += w2[c] * m
                    ds += dw2[c] * m
                w01 = w0[a] * w1[b]
                value += w01 * s
                g0 += dw0[a] * w1[b] * s
                g1 += w0[a] * dw1[b] * s
                g2 += w01 * ds
        values[i] = value
        gradients[i] = wp.vec3d(g0, g1, g2)

    return spread, gather


def every_kernel() -> list:
    """Every kernel this module builds on demand: ``(spread, gather)`` of each order 1..``MAX_ORDER``.

    The kernels live in per-order modules made by :func:`mesh_kernels`, so this module's own Warp module holds
    none; ahead-of-time compilation (``tests/test_warp_cuda_compile.py``) reaches them through this list.

    Returns
    -------
    list
        The Warp kernels, two per order, in order.
    """
    return [kernel for order in range(1, MAX_ORDER + 1) for kernel in mesh_kernels(order)]
