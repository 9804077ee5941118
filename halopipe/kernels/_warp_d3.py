"""Warp sources of the lattice-sum D3 kernels (imported only when Warp loads).

One thread per owned atom ``i`` walks a cell list of *all* atoms, wrapped
into the cell, and sums each partner ``j`` over its lattice images
``r_j + t @ cell`` inside the cutoff sphere, so no periodic image is ever a
row. The images of one ``j`` are the translations ``t`` within the sphere's
bounding box in fractional coordinates (:func:`_box_range`), each tested by
its distance. (Solving for the exact range of ``t`` on each line of images
cost more than the box's extra distance tests: a square root per line
against a few multiply-adds per test.) Each unordered pair ``{i, j}`` is taken by one of its two
threads (``i < j`` when ``i + j`` is even, ``i > j`` when odd, so every atom
takes about half of its partners whatever the id order; an atom's pairs with
its own images where ``t`` is lexicographically positive), and its
contributions go to both ends with atomics.

``term`` selects what a pair contributes: coordination-number counts
(``CN_COUNT``), the CN chain forces ``(a_i + a_j) dcount/dd``
(``CN_CHAIN``), or the two-body dispersion (``TWO_BODY``: per pair ``{i, j}``
the image sums are formed first and ``C6_ij`` is read once, as
``v_i[s_j] . w_j`` with ``v_i[s] = w_i^T C6ref(Z_i, s)`` formed per atom,
then energy, forces and ``dE/dC6`` times the partner's weights, ``u``).

The loops over a partner's images are ``while`` loops, each variable
advanced first so that ``continue`` skips nothing: Warp's ``range`` tests
its run-time step on every iteration (see :mod:`._warp_lists`), a cost in
loops of one to three images. Energy, forces and stress keep their bits;
si-512, urea-432 and rutile-576 (two-body, one thread): 1.5-2.3 % faster in
two interleaved rounds.
"""

from __future__ import annotations

import warp as wp

wp.set_module_options({"enable_backward": False})

TWO_BODY, CN_COUNT, CN_CHAIN, NEIGHBOUR_COUNT, NEIGHBOUR_FILL = 0, 1, 2, 3, 4
vec6d = wp.types.vector(length=6, dtype=wp.float64)  # the six components of a symmetric 3 x 3 sum


@wp.func
def _box_range(df: wp.float64, half: wp.float64, periodic: wp.int32):
    """Translations ``t`` with ``|df + t| <= half`` (fractional), ``(0, 0)`` on an open axis."""
    if periodic == 0:
        return wp.vec2i(0, 0)
    return wp.vec2i(wp.int32(wp.ceil(-df - half)), wp.int32(wp.floor(-df + half)))


@wp.func
def _bin_span(f: wp.float64, half: wp.float64, origin: wp.float64, span: wp.float64, nb: wp.int32, periodic: wp.int32):
    """First bin (unwrapped) and number of bins along one axis within ``half`` of ``f`` (fractional)."""
    scale = wp.float64(nb) / span
    lo = wp.floor((f - half - origin) * scale)
    hi = wp.floor((f + half - origin) * scale)
    if periodic != 0:
        if hi - lo + wp.float64(1.0) >= wp.float64(nb):
            return wp.vec2i(0, nb)
        return wp.vec2i(wp.int32(lo), wp.int32(hi - lo) + 1)
    # Clamped before the conversion: on an open axis of near-zero extent the scale is huge.
    first = wp.int32(wp.max(lo, wp.float64(0.0)))
    last = wp.int32(wp.min(hi, wp.float64(nb - 1)))
    return wp.vec2i(first, wp.max(last - first + 1, 0))


@wp.func
def _wrap(k: wp.int32, n: wp.int32):
    return ((k % n) + n) % n


@wp.func
def _lex_positive(tx: wp.int32, ty: wp.int32, tz: wp.int32):
    return tx > 0 or (tx == 0 and (ty > 0 or (ty == 0 and tz > 0)))


@wp.func
def _cn_count(inverse_r: wp.float64, rcov_sum: wp.float64, k1: wp.float64):
    """D3 counting function 1 / (1 + exp(-k1 (rcov_sum / r - 1))) as a sigmoid."""
    return wp.float64(1.0) / (wp.float64(1.0) + wp.exp(k1 - k1 * rcov_sum * inverse_r))


@wp.func
def _dispersion(r2: wp.float64, q6: wp.float64, q8: wp.float64, zero_damping: wp.bool):
    """``(e6, e8, h6, h8)``: the damped ``r^-6``, ``r^-8`` terms and ``-d e_n / dd = h_n d``.

    BJ: ``e_n = 1 / (r^n + q_n)`` with ``q_n = R0^n``. Zero damping:
    ``e_n = 1 / (r^n (1 + 6 (q_n / r^2)^(n/2 + 4)))`` with ``q_n = (rs_n R0)^2``
    (alpha6 = 14, alpha8 = 16).
    """
    r4 = r2 * r2
    r6 = r4 * r2
    r8 = r6 * r2
    if zero_damping:
        x = q6 / r2
        x2 = x * x
        x7 = x2 * x2 * x2 * x
        y = q8 / r2
        y2 = y * y
        y4 = y2 * y2
        y8 = y4 * y4
        e6 = wp.float64(1.0) / (r6 * (wp.float64(1.0) + wp.float64(6.0) * x7))
        e8 = wp.float64(1.0) / (r8 * (wp.float64(1.0) + wp.float64(6.0) * y8))
        h6 = wp.float64(6.0) * r4 * (wp.float64(1.0) - wp.float64(8.0) * x7) * e6 * e6
        h8 = wp.float64(8.0) * r6 * (wp.float64(1.0) - wp.float64(6.0) * y8) * e8 * e8
        return wp.vec4d(e6, e8, h6, h8)
    denom6 = r6 + q6
    denom8 = r8 + q8
    inverse = wp.float64(1.0) / (denom6 * denom8)  # one division for both terms
    e6 = denom8 * inverse
    e8 = denom6 * inverse
    return wp.vec4d(e6, e8, wp.float64(6.0) * r4 * e6 * e6, wp.float64(8.0) * r6 * e8 * e8)


def _lattice_kernel(term: int, zero_damping: bool, virial: bool, store: bool = False, sparse: bool = False):
    """The thread-per-owned-atom lattice sum of one ``term`` (see the module docstring).

    ``store`` (``CN_COUNT``): also write each pair's image sums ``sum_t h d``
    (and ``sum_t h d (x) d`` with ``virial``) at ``[thread, partner]``, so the
    chain forces need no second walk. ``sparse``: ``sum_t h d`` only, at ``[thread, slot]`` instead,
    the thread's partners in walk order, the partner in ``nbr_atom[thread *
    capacity + slot]`` (``capacity = pair_grad.shape[1]``) and the partners
    counted in ``nbr_count`` (those past the capacity are counted, not written).
    """

    @wp.kernel
    def lattice_d3(
        owned: wp.array(dtype=wp.int32),
        pos: wp.array(dtype=wp.vec3d),
        frac: wp.array(dtype=wp.vec3d),
        lattice_a: wp.vec3d,
        lattice_b: wp.vec3d,
        lattice_c: wp.vec3d,
        periodic: wp.vec3i,
        origin: wp.vec3d,
        span: wp.vec3d,
        half_width: wp.vec3d,
        nb: wp.vec3i,
        bin_start: wp.array(dtype=wp.int32),
        bin_atoms: wp.array(dtype=wp.int32),
        rc2: wp.float64,
        species: wp.array(dtype=wp.int32),
        rcov: wp.array(dtype=wp.float64),
        k1: wp.float64,
        cn_grad: wp.array(dtype=wp.float64),
        ref_weights: wp.array2d(dtype=wp.float64),
        v: wp.array3d(dtype=wp.float64),
        c8_over_c6: wp.array(dtype=wp.float64),
        q6: wp.array(dtype=wp.float64),
        q8: wp.array(dtype=wp.float64),
        n_species: wp.int32,
        s6: wp.float64,
        s8: wp.float64,
        cn: wp.array(dtype=wp.float64),
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
        u: wp.array3d(dtype=wp.float64),
        vir: wp.array(dtype=wp.mat33d),
        pair_grad: wp.array2d(dtype=wp.vec3d),
        pair_outer: wp.array2d(dtype=wp.mat33d),
        nbr_start: wp.array(dtype=wp.int32),
        nbr_count: wp.array(dtype=wp.int32),
        nbr_atom: wp.array(dtype=wp.int32),
        nbr_shift: wp.array(dtype=wp.vec3i),
        nbr_vec: wp.array(dtype=wp.vec3d),
    ):
        k = wp.tid()
        i = owned[k]
        ri = pos[i]
        fi = frac[i]
        si = species[i]
        n_ref = ref_weights.shape[1]
        span_x = _bin_span(fi[0], half_width[0], origin[0], span[0], nb[0], periodic[0])
        span_y = _bin_span(fi[1], half_width[1], origin[1], span[1], nb[1], periodic[1])
        span_z = _bin_span(fi[2], half_width[2], origin[2], span[2], nb[2], periodic[2])
        cn_i = wp.float64(0.0)
        vir_i = wp.mat33d()
        listed = int(0)  # noqa: UP018 - Warp: a dynamic variable (neighbours of i so far)
        for cx in range(span_x[1]):
            bx = _wrap(span_x[0] + cx, nb[0])
            for cy in range(span_y[1]):
                by = _wrap(span_y[0] + cy, nb[1])
                for cz in range(span_z[1]):
                    b = (bx * nb[1] + by) * nb[2] + _wrap(span_z[0] + cz, nb[2])
                    for slot in range(bin_start[b], bin_start[b + 1]):
                        j = bin_atoms[slot]
                        if wp.static(term < NEIGHBOUR_COUNT):
                            if j != i and (((i + j) & 1) == 0) != (i < j):
                                continue  # the partner's thread takes this pair
                        sj = species[j]
                        p = si * n_species + sj
                        d0 = pos[j] - ri
                        rcov_sum = wp.float64(0.0)
                        coef = wp.float64(0.0)
                        qa = wp.float64(0.0)
                        qb = wp.float64(0.0)
                        qq = wp.float64(0.0)
                        if wp.static(term != TWO_BODY):
                            rcov_sum = rcov[i] + rcov[j]
                            if wp.static(term == CN_CHAIN):
                                coef = cn_grad[i] + cn_grad[j]
                        else:
                            qa = q6[p]
                            qb = q8[p]
                            qq = c8_over_c6[p]
                        total = wp.float64(0.0)  # counts (CN_COUNT), or the damped r^-6 sum (TWO_BODY)
                        total8 = wp.float64(0.0)
                        grad = wp.vec3d()  # sum over images of -dE/dd / (coefficient)
                        sym = vec6d()  # sum of h d (x) d: xx, yy, zz, xy, xz, yz
                        hits = int(0)  # noqa: UP018 - Warp: a dynamic variable, mutated in the loops
                        df = frac[j] - fi
                        range_x = _box_range(df[0], half_width[0], periodic[0])
                        range_y = _box_range(df[1], half_width[1], periodic[1])
                        range_z = _box_range(df[2], half_width[2], periodic[2])
                        tx = range_x[0] - 1
                        while tx < range_x[1]:
                            tx += 1
                            d1 = d0 + wp.float64(tx) * lattice_a
                            ty = range_y[0] - 1
                            while ty < range_y[1]:
                                ty += 1
                                d2 = d1 + wp.float64(ty) * lattice_b
                                tz = range_z[0] - 1
                                while tz < range_z[1]:
                                    tz += 1
                                    if wp.static(term < NEIGHBOUR_COUNT):
                                        if j == i and not _lex_positive(tx, ty, tz):
                                            continue
                                    elif j == i and tx == 0 and ty == 0 and tz == 0:
                                        continue  # a neighbour list holds every image but the atom itself
                                    d = d2 + wp.float64(tz) * lattice_c
                                    r2 = wp.dot(d, d)
                                    if r2 > rc2:
                                        continue
                                    hits += 1
                                    if wp.static(term >= NEIGHBOUR_COUNT):
                                        if wp.static(term == NEIGHBOUR_FILL):
                                            entry = nbr_start[k] + listed
                                            nbr_atom[entry] = j
                                            nbr_shift[entry] = wp.vec3i(tx, ty, tz)
                                            nbr_vec[entry] = d
                                        listed += 1
                                        continue
                                    h = wp.float64(0.0)
                                    if wp.static(term == TWO_BODY):
                                        terms = _dispersion(r2, qa, qb, wp.static(zero_damping))
                                        total += terms[0]
                                        total8 += terms[1]
                                        h = s6 * terms[2] + s8 * qq * terms[3]
                                    else:
                                        inverse_r = wp.float64(1.0) / wp.sqrt(r2)
                                        count = _cn_count(inverse_r, rcov_sum, k1)
                                        total += count
                                        # d count / d r = -count (1 - count) k1 rcov_sum / r^2, along d / r.
                                        h = count * (wp.float64(1.0) - count) * k1 * rcov_sum * inverse_r * inverse_r * inverse_r
                                    hd = h * d
                                    grad += hd
                                    if wp.static(virial):
                                        sym += vec6d(hd[0] * d[0], hd[1] * d[1], hd[2] * d[2], hd[0] * d[1], hd[0] * d[2], hd[1] * d[2])
                        if hits == 0:
                            continue
                        outer = wp.mat33d(sym[0], sym[3], sym[4], sym[3], sym[1], sym[5], sym[4], sym[5], sym[2])
                        if wp.static(term == CN_COUNT):
                            cn_i += total
                            wp.atomic_add(cn, j, total)
                            if wp.static(store and sparse):  # this thread's partners and their chain terms, in walk order
                                capacity = pair_grad.shape[1]
                                if listed < capacity:
                                    pair_grad[k, listed] = grad
                                    nbr_atom[k * capacity + listed] = j
                                listed += 1
                            elif wp.static(store):  # this thread's row of the chain terms, for a pass without the walk
                                pair_grad[k, j] = grad
                                if wp.static(virial):
                                    pair_outer[k, j] = outer
                        if wp.static(term == CN_CHAIN):
                            # E depends on d through CN_i and CN_j: dE/dd = -(a_i + a_j) h d.
                            f = -coef * grad
                            wp.atomic_add(forces, i, f)
                            wp.atomic_sub(forces, j, f)
                            if wp.static(virial):
                                vir_i -= coef * outer
                        if wp.static(term == TWO_BODY):
                            c6 = wp.float64(0.0)
                            for ref in range(n_ref):
                                c6 += v[i, sj, ref] * ref_weights[j, ref]
                            per_c6 = -(s6 * total + s8 * qq * total8)  # dE/dC6 of the pair
                            half = wp.float64(0.5) * c6 * per_c6
                            wp.atomic_add(energies, i, half)
                            wp.atomic_add(energies, j, half)
                            f = c6 * grad  # dE/dd = C6 h d; the force on i is +dE/dd
                            wp.atomic_add(forces, i, f)
                            wp.atomic_sub(forces, j, f)
                            for ref in range(n_ref):
                                wp.atomic_add(u, i, sj, ref, per_c6 * ref_weights[j, ref])
                                wp.atomic_add(u, j, si, ref, per_c6 * ref_weights[i, ref])
                            if wp.static(virial):
                                vir_i += c6 * outer
        if wp.static(term == CN_COUNT):
            wp.atomic_add(cn, i, cn_i)
        if wp.static(term == NEIGHBOUR_COUNT or sparse):
            nbr_count[k] = listed
        if wp.static(virial and term != CN_COUNT):  # the walk of the counts keeps its virial terms per pair
            vir[k] = vir_i

    return lattice_d3


lattice_cn_count = _lattice_kernel(CN_COUNT, False, False)
lattice_cn_count_store = _lattice_kernel(CN_COUNT, False, False, store=True)
lattice_cn_count_store_virial = _lattice_kernel(CN_COUNT, False, True, store=True)
lattice_cn_count_sparse = _lattice_kernel(CN_COUNT, False, False, store=True, sparse=True)
lattice_cn_chain = _lattice_kernel(CN_CHAIN, False, False)
lattice_cn_chain_virial = _lattice_kernel(CN_CHAIN, False, True)
lattice_bj = _lattice_kernel(TWO_BODY, False, False)
lattice_bj_virial = _lattice_kernel(TWO_BODY, False, True)
lattice_zero = _lattice_kernel(TWO_BODY, True, False)
lattice_zero_virial = _lattice_kernel(TWO_BODY, True, True)
lattice_neighbour_count = _lattice_kernel(NEIGHBOUR_COUNT, False, False)
lattice_neighbour_fill = _lattice_kernel(NEIGHBOUR_FILL, False, False)


@wp.func
def _member_less(id1: wp.int32, t1: wp.vec3i, id2: wp.int32, t2: wp.vec3i):
    """Order of the members of a triple: by atom, then by image (translation, lexicographically)."""
    if id1 != id2:
        return id1 < id2
    return _lex_positive(t2[0] - t1[0], t2[1] - t1[1], t2[2] - t1[2])


def _atm_kernel(virial: bool):
    """ATM three-body energy over each owned atom's neighbour list (all images within the ATM cutoff).

    A thread takes the pairs ``{(b, t_b), (c, t_c)}`` of its atom ``a``'s
    neighbours that are also within the cutoff of each other. Every triple is
    seen from each of its three members, so one of them evaluates it: sorting
    the members by (atom, image), the one at rank ``(a + b + c) mod 3``
    (which spreads the work whatever the id order). Its energy goes a third
    to each member, forces to all three; ``dE/dC6`` of the pairs with ``a``
    are kept per neighbour entry (``nbr_grad``), that of ``(b, c)`` goes
    into ``u`` (as in the two-body kernel).
    """

    @wp.kernel
    def lattice_atm(
        owned: wp.array(dtype=wp.int32),
        nbr_start: wp.array(dtype=wp.int32),
        nbr_atom: wp.array(dtype=wp.int32),
        nbr_shift: wp.array(dtype=wp.vec3i),
        nbr_vec: wp.array(dtype=wp.vec3d),
        nbr_c6: wp.array(dtype=wp.float64),
        nbr_inv_c6: wp.array(dtype=wp.float64),
        species: wp.array(dtype=wp.int32),
        n_species: wp.int32,
        r0: wp.array(dtype=wp.float64),
        ref_weights: wp.array2d(dtype=wp.float64),
        v: wp.array3d(dtype=wp.float64),
        s9: wp.float64,
        rc2: wp.float64,
        energies: wp.array(dtype=wp.float64),
        forces: wp.array(dtype=wp.vec3d),
        u: wp.array3d(dtype=wp.float64),
        nbr_grad: wp.array(dtype=wp.float64),
        vir: wp.array(dtype=wp.mat33d),
    ):
        k = wp.tid()
        a = owned[k]
        sa = species[a]
        n_ref = ref_weights.shape[1]
        zero = wp.vec3i(0, 0, 0)
        energy_a = wp.float64(0.0)
        force_a = wp.vec3d()
        vir_a = wp.mat33d()
        third = wp.float64(1.0) / wp.float64(3.0)
        for p in range(nbr_start[k], nbr_start[k + 1]):
            b = nbr_atom[p]
            tb = nbr_shift[p]
            dab = nbr_vec[p]
            x = wp.dot(dab, dab)
            sb = species[b]
            c6ab = nbr_c6[p]
            r0ab = r0[sa * n_species + sb]
            grad_ab = wp.float64(0.0)
            b_first = int(0)  # noqa: UP018 - Warp: a dynamic variable (1 when (b, t_b) precedes (a, 0))
            if _member_less(b, tb, a, zero):
                b_first = 1
            for q in range(p + 1, nbr_start[k + 1]):
                dac = nbr_vec[q]
                dbc = dac - dab
                z = wp.dot(dbc, dbc)
                if z > rc2:
                    continue
                c = nbr_atom[q]
                tc = nbr_shift[q]
                rank = b_first
                if _member_less(c, tc, a, zero):
                    rank += 1
                if rank != (a + b + c) % 3:
                    continue  # another member's thread evaluates this triple
                sc = species[c]
                y = wp.dot(dac, dac)
                c6ac = nbr_c6[q]
                c6bc = wp.float64(0.0)
                for ref in range(n_ref):
                    c6bc += v[b, sc, ref] * ref_weights[c, ref]
                c9 = s9 * wp.sqrt(c6ab * c6ac * c6bc)
                rr0 = r0ab * r0[sa * n_species + sc] * r0[sb * n_species + sc]
                # Few divisions: everything from 1 / (r_ab r_ac r_bc)^2 (a division costs tens of multiplies).
                inv_r2 = wp.float64(1.0) / (x * y * z)
                inv_r3 = inv_r2 * wp.sqrt(inv_r2)
                inv_r5 = inv_r3 * inv_r2
                t = rr0 * rr0 * inv_r2  # (r0 / r1)^2: the damping's (r0 / r1)^(16/3) is t^(8/3)
                cube_root = wp.cbrt(t)
                damp_term = wp.float64(6.0) * t * t * cube_root * cube_root
                fdamp = wp.float64(1.0) / (wp.float64(1.0) + damp_term)
                ea = x + z - y
                eb = x + y - z
                ec = y + z - x
                poly = ea * eb * ec
                ang = wp.float64(0.375) * poly * inv_r5 + inv_r3
                energy = c9 * fdamp * ang
                # d/dx of fdamp (x = r_ab^2; y, z alike): fdamp^2 damp_term (8/3) / x.
                ddamp = fdamp * fdamp * damp_term * wp.float64(8.0) / wp.float64(3.0)
                common_x = wp.float64(0.375) * (eb * ec + ea * ec - ea * eb) * inv_r5
                common_y = wp.float64(0.375) * (ea * ec + ea * eb - eb * ec) * inv_r5
                common_z = wp.float64(0.375) * (eb * ec + ea * eb - ea * ec) * inv_r5
                tail = wp.float64(0.9375) * poly * inv_r5 + wp.float64(1.5) * inv_r3  # 0.375 * 2.5 = 0.9375
                per_x = ddamp * ang - fdamp * tail  # (d E / d x) x / c9, minus the polynomial's own part
                de_dx = c9 * (per_x * y * z * inv_r2 + fdamp * common_x)
                de_dy = c9 * (per_x * x * z * inv_r2 + fdamp * common_y)
                de_dz = c9 * (per_x * x * y * inv_r2 + fdamp * common_z)
                gab = wp.float64(2.0) * de_dx * dab  # dE/d(r_b - r_a)
                gac = wp.float64(2.0) * de_dy * dac
                gbc = wp.float64(2.0) * de_dz * dbc
                share = energy * third
                energy_a += share
                wp.atomic_add(energies, b, share)
                wp.atomic_add(energies, c, share)
                force_a += gab + gac
                wp.atomic_add(forces, b, gbc - gab)
                wp.atomic_sub(forces, c, gac + gbc)
                if wp.static(virial):
                    vir_a += wp.outer(dab, gab) + wp.outer(dac, gac) + wp.outer(dbc, gbc)
                # E grows as sqrt(C6ab C6ac C6bc): dE/dC6 = E / (2 C6) for each pair.
                half_energy = wp.float64(0.5) * energy
                grad_ab += half_energy * nbr_inv_c6[p]
                wp.atomic_add(nbr_grad, q, half_energy * nbr_inv_c6[q])
                g_bc = half_energy / c6bc
                for ref in range(n_ref):
                    wp.atomic_add(u, b, sc, ref, g_bc * ref_weights[c, ref])
                    wp.atomic_add(u, c, sb, ref, g_bc * ref_weights[b, ref])
            wp.atomic_add(nbr_grad, p, grad_ab)
        wp.atomic_add(energies, a, energy_a)
        wp.atomic_add(forces, a, force_a)
        if wp.static(virial):
            vir[k] = vir_a

    return lattice_atm


lattice_atm = _atm_kernel(False)
lattice_atm_virial = _atm_kernel(True)


@wp.kernel
def sparse_cn_chain(
    owned: wp.array(dtype=wp.int32),
    atom: wp.array(dtype=wp.int32),
    count: wp.array(dtype=wp.int32),
    pair_grad: wp.array2d(dtype=wp.vec3d),
    cn_grad: wp.array(dtype=wp.float64),
    forces: wp.array(dtype=wp.vec3d),
):
    """The CN chain forces from the sparse store of the counting walk: thread ``k``'s stored partners, no walk."""
    k = wp.tid()
    i = owned[k]
    capacity = pair_grad.shape[1]
    a_i = cn_grad[i]
    f_i = wp.vec3d()
    for slot in range(wp.min(count[k], capacity)):
        j = atom[k * capacity + slot]
        f = -(a_i + cn_grad[j]) * pair_grad[k, slot]  # on i; the partner gets the opposite
        f_i += f
        wp.atomic_sub(forces, j, f)
    wp.atomic_add(forces, i, f_i)
