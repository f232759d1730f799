"""Multi-head token-wise matching (SCORER §3.2.1, used again by CBR §3.4) and the InfoNCE losses.

Token-wise matching of a query set Q (N tokens) to a key set K (M tokens), in one head:
``t2v = mean_l max_m <q_l, k_m>`` and ``v2t = mean_m max_l <q_l, k_m>``; TM = (t2v + v2t) / 2 (Eq. 2).
The multi-head version (Eq. 3) matches each head's feature subspace separately and averages the heads.
Over a batch it gives a B×B similarity matrix whose diagonal holds the matching pairs.

Why a custom autograd function: the naive computation materialises the whole B×B×heads×N×M similarity
tensor (≈5·10⁹ numbers at batch 128 with 8 heads and 196 tokens); autograd keeps its max indices as int64
and, backwards, scatters the gradient into a zero-filled tensor of that size before two more products of
that size. Here the similarities are computed in cache-sized chunks, reduced to their maxima at once and
never stored; only the winners' indices are kept (int16), and the backward pass gathers the winning keys and
queries: O(B²·h·N·d) work instead of two B²·h·N·M·d products.

On CPU in float32, both reductions of a chunk (maxima and first arg-maxima over the keys and over the
queries) run in one C pass while the chunk is still in the cache, and so do the backward gathers and
scatter-adds (``token_matching.c``, compiled on first use by ``token_matching_native``): the forward at
batch 32 went from 0.55 to 0.21 s, the backward from 0.15 to 0.035 s. Elsewhere, or without a C compiler,
the same chunks are reduced with torch operations: ``amax`` and a sign/matrix-vector trick
(``_row_argmax``), because ``torch.max`` with indices is far slower than ``amax`` on CPU. Both paths give
the value and the gradient of the naive formula (at an exact tie the winner is ``torch.max``'s, the first
maximum; tested with forced ties); they differ only in the rounding of the means. The C path's values and
gradients are also identical whatever the number of threads (each output row is summed by one worker in a
fixed order); the torch path's key gradients depend on it in the last bits.

Departure of the official code (``models/SCORER.py``): its einsum ``ahld,bhmd->ablm`` sums over the heads
before the max, i.e. it matches the full 512-d vectors in a single head. We follow the paper's multi-head
matching (the paper's Fig. 3 ablates exactly "TM without multi-head").
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline.models import token_matching_native
from pipeline.models.token_matching_native import strides as native_strides

# Similarity numbers computed per chunk: small enough to stay in the CPU caches, big enough to amortise
# the per-call overhead (measured with benchmarks/bench_transformers.py).
CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 27}


_POOLS: dict[int, cf.ThreadPoolExecutor] = {}


def _run_parallel(device: torch.device, work: Callable[[int, int], None], n_items: int) -> None:
    """Run ``work(lo, hi)`` over contiguous parts of ``range(n_items)``.

    On CPU the chunk loops are made of thousands of small, cache-sized operations. Run each on one intra-op
    thread and give every core its own part of the loop instead: an OpenMP parallel region per small
    operation stalls on a busy machine whenever one worker is descheduled (measured here: the forward at
    batch 8 took 11-21 s with 2 OpenMP threads under load against 0.5 s on one thread), while independent
    workers just proceed. Each part writes disjoint outputs, so the result does not depend on the timing.
    """
    if device.type != "cpu":
        work(0, n_items)
        return
    n_threads = torch.get_num_threads()
    parts = max(1, min(n_threads, n_items))
    bounds = [n_items * i // parts for i in range(parts + 1)]
    grad = torch.is_grad_enabled()  # thread-local: the workers must see the caller's mode

    def run(lo, hi):
        with torch.set_grad_enabled(grad):
            work(lo, hi)

    torch.set_num_threads(1)
    try:
        if parts == 1:
            work(0, n_items)
        else:
            pool = _POOLS.get(parts) or _POOLS.setdefault(parts, cf.ThreadPoolExecutor(parts, "token-matching"))
            for f in [pool.submit(run, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]:
                f.result()
    finally:
        torch.set_num_threads(n_threads)


def _native(q: torch.Tensor, idx_dtype: torch.dtype):
    """The C kernels where they apply (float32 on CPU, int16 winner indices) and could be built, else None."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or idx_dtype != torch.int16:
        return None
    return token_matching_native.load()


def _budget(table: dict, device: torch.device, override: int | None) -> int:
    return override or table.get(device.type, table["cuda"])


def _chunks(a_n: int, b_n: int, per_pair: int, budget: int):
    """Blocks (a0, a1, b0, b1) of query items × key items whose similarities hold about ``budget`` numbers."""
    cb = max(1, min(b_n, budget // per_pair))
    ca = max(1, min(a_n, budget // (per_pair * cb)))
    for a0 in range(0, a_n, ca):
        for b0 in range(0, b_n, cb):
            yield a0, min(a_n, a0 + ca), b0, min(b_n, b0 + cb)


def _row_argmax(s: torch.Tensor, v: torch.Tensor, work: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Index of the maximum along the last dim of ``s`` [R, M], given its maxima ``v`` [R, 1], as float.

    On CPU ``torch.max`` with indices is ~20× slower than ``amax``; here sign(s − v) is 0 at the maximum and −1
    elsewhere, so Σ_m m·sign + Σ_m m is the index (a matrix-vector product, exact in float32 for m < 2^12)
    and Σ sign + M counts the maxima. Rows with an exact tie fall back to ``torch.max`` (same winner).
    """
    torch.sub(s, v, out=work).sign_()
    m = s.shape[-1]
    idx = work @ positions + m * (m - 1) / 2
    ties = (work.sum(-1) + m) != 1
    if bool(ties.any()):
        idx[ties] = s[ties].max(-1).indices.to(idx.dtype)
    return idx


def _argmax_cpu(s: torch.Tensor, work: torch.Tensor, pos_n: torch.Tensor, pos_m: torch.Tensor):
    """``s`` [h, ca, N, cb, M] -> (row maxima [h, ca, N, cb], their m, column maxima [h, ca, cb, M], their l)."""
    h, ca, n, cb, m = s.shape
    v1 = s.amax(-1, keepdim=True)
    i1 = _row_argmax(s.view(-1, m), v1.view(-1, 1), work.view(-1, m), pos_m)
    # Columns: the same on the transposed blocks (sign(s − column max), summed over l).
    v2 = s.amax(2, keepdim=True)
    w = torch.sub(s, v2, out=work.view(s.shape)).sign_().view(h * ca, n, cb * m)
    i2 = (pos_n @ w).view(h, ca, cb, m) + n * (n - 1) / 2
    ties = (w.sum(1).view(h, ca, cb, m) + n) != 1
    if bool(ties.any()):
        hh, aa, bb, mm = ties.nonzero(as_tuple=True)
        i2[hh, aa, bb, mm] = s[hh, aa, :, bb, mm].max(-1).indices.to(i2.dtype)
    return v1.view(h, ca, n, cb), i1.view(h, ca, n, cb), v2.view(h, ca, cb, m), i2


class _TokenMax(torch.autograd.Function):
    """(q [h, A, N, d], k [h, B, M, d]) -> (t2v [h, A, B], v2t [h, A, B]).

    Forward: per chunk, one batched product and the two max reductions; the winners' indices are kept
    (int16: 2 bytes per (a, b, h, token)). Backward: each t2v winner (a, l) -> (b, m*) sends g/N·k[b, m*] to
    q[a, l] and g/N·q[a, l] to k[b, m*] (likewise for v2t), by gathers and index additions.
    """

    @staticmethod
    def forward(ctx, q, k, chunk_elements):
        h, a_n, n, d = q.shape
        b_n, m = k.shape[1], k.shape[2]
        kt = k.reshape(h, b_n * m, d).transpose(1, 2).contiguous()  # [h, d, B*M]: row-major GEMM operand
        acc = torch.promote_types(q.dtype, torch.float32)
        t2v = q.new_empty(h, a_n, b_n, dtype=acc)
        v2t = q.new_empty(h, a_n, b_n, dtype=acc)
        idx_dtype = torch.int16 if max(n, m) < 2**15 else torch.int64
        idx1 = torch.empty(h, a_n, n, b_n, dtype=idx_dtype, device=q.device)  # argmax over m of each (a, l, b)
        idx2 = torch.empty(h, a_n, b_n, m, dtype=idx_dtype, device=q.device)  # argmax over l of each (a, b, m)
        lib = _native(q, idx_dtype)
        # The sign trick needs exact integer sums: float32/64 on CPU with fewer than 2^12 tokens.
        fast = q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and max(n, m) < 2**12
        chunks = list(_chunks(a_n, b_n, h * n * m, _budget(CHUNK_ELEMENTS, q.device, chunk_elements)))
        _run_parallel(q.device, lambda lo, hi: _TokenMax._forward_chunks(q, kt, t2v, v2t, idx1, idx2, fast, lib,
                                                                          chunks[lo:hi]), len(chunks))
        ctx.save_for_backward(q, k, idx1, idx2)
        ctx.chunk_elements = chunk_elements
        return t2v, v2t

    @staticmethod
    def _forward_chunks(q, kt, t2v, v2t, idx1, idx2, fast, lib, chunks):
        """Product and reductions of each chunk: in one C pass where ``lib`` is given, else with torch."""
        h, a_n, n, d = q.shape
        m = idx2.shape[3]
        acc = t2v.dtype
        if lib is not None:
            strides = [native_strides(*t.stride()) for t in (t2v, idx1, idx2)]
            fast = False
        if fast:
            pos_n = torch.arange(n, dtype=q.dtype).view(1, n)
            pos_m = torch.arange(m, dtype=q.dtype)
        buf = work = None
        for a0, a1, b0, b1 in chunks:
            ca, cb = a1 - a0, b1 - b0
            if buf is None or buf.numel() != h * ca * n * cb * m:  # reused: fresh pages cost more than the product
                buf = q.new_empty(h, ca * n, cb * m)
                work = torch.empty_like(buf) if fast else None
            s = torch.bmm(q[:, a0:a1].reshape(h, ca * n, d), kt[:, :, b0 * m:b1 * m], out=buf).view(h, ca, n, cb, m)
            if lib is not None:  # results written straight into views of the batch's outputs
                st, s1, s2 = strides
                if lib.tm_reduce_chunk(buf.data_ptr(), h, ca, n, cb, m, t2v[:, a0:, b0:].data_ptr(),
                                       v2t[:, a0:, b0:].data_ptr(), st, idx1[:, a0:, :, b0:].data_ptr(), s1,
                                       idx2[:, a0:, b0:].data_ptr(), s2):
                    raise MemoryError("token matching: the C kernel could not allocate its scratch memory")
                continue
            if fast:
                v1, i1, v2, i2 = _argmax_cpu(s, work, pos_n, pos_m)
            else:
                (v1, i1), (v2, i2) = s.max(-1), s.max(2)
            t2v[:, a0:a1, b0:b1] = v1.sum(2, dtype=acc) / n
            idx1[:, a0:a1, :, b0:b1] = i1
            v2t[:, a0:a1, b0:b1] = v2.sum(-1, dtype=acc) / m
            idx2[:, a0:a1, b0:b1] = i2
        return t2v, v2t

    @staticmethod
    def backward(ctx, g1, g2):
        q, k, idx1, idx2 = ctx.saved_tensors
        h, a_n, n, d = q.shape
        b_n, m = k.shape[1], k.shape[2]
        acc = torch.promote_types(q.dtype, torch.float32)
        qf, kf = q.to(acc), k.to(acc)
        dq = torch.zeros(h * a_n * n, d, device=q.device, dtype=acc)
        dk = torch.zeros(h * b_n * m, d, device=q.device, dtype=acc)
        w1 = None if g1 is None else g1.to(acc) / n  # d t2v / d s = 1/N at each row's winner
        w2 = None if g2 is None else g2.to(acc) / m  # d v2t / d s = 1/M at each column's winner
        lib = _native(q, idx1.dtype)
        if lib is not None:
            # dq split over query items, dk over key items: each row summed by one worker in a fixed order,
            # so the gradients do not depend on the number of threads (and need no per-worker copies of dk).
            w1 = None if w1 is None else w1.contiguous()
            w2 = None if w2 is None else w2.contiguous()
            qf, kf = qf.contiguous(), kf.contiguous()
            args = (qf.data_ptr(), kf.data_ptr(), h, a_n, n, b_n, m, d, idx1.data_ptr(), idx2.data_ptr(),
                    None if w1 is None else w1.data_ptr(), None if w2 is None else w2.data_ptr())
            _run_parallel(q.device, lambda lo, hi: lib.tm_backward_dq(*args, dq.data_ptr(), lo, hi), a_n)
            _run_parallel(q.device, lambda lo, hi: lib.tm_backward_dk(*args, dk.data_ptr(), lo, hi), b_n)
            return dq.view(h, a_n, n, d).to(q.dtype), dk.view(h, b_n, m, d).to(k.dtype), None

        # dq rows belong to one query item (disjoint between parts); dk is shared: one accumulator per part,
        # summed in a fixed order afterwards.
        dks: dict[int, torch.Tensor] = {}
        budget = _budget(CHUNK_ELEMENTS, q.device, ctx.chunk_elements)

        def part(lo, hi):
            dks[lo] = dk if lo == 0 else torch.zeros_like(dk)
            _TokenMax._backward_items(w1, w2, qf, kf, idx1, idx2, dq, dks[lo], lo, hi, budget)

        _run_parallel(q.device, part, a_n)
        for lo in sorted(dks)[1:]:
            dk += dks[lo]
        return dq.view(h, a_n, n, d).to(q.dtype), dk.view(h, b_n, m, d).to(k.dtype), None

    @staticmethod
    def _backward_items(w1, w2, qf, kf, idx1, idx2, dq, dk, lo, hi, budget):
        """Query items ``lo``..``hi - 1`` in groups: gather the winners, weight, and add them to dq and dk. A
        group holds about ``budget`` gathered numbers ([h, items, N, B, d]: 51 M a query item at the papers' batch
        128), so a GPU launches ~10 kernels per group instead of per item (one item a time was ~2,400 launches a
        SCORER step at batch 16 on an H200, docs/measurements.md); the scratch is reused, since fresh pages cost
        more than the arithmetic."""
        h, a_n, n, d = qf.shape
        b_n, m = kf.shape[1], kf.shape[2]
        dev = qf.device
        k_rows, q_rows = kf.reshape(h * b_n * m, d), qf.reshape(h * a_n * n, d)
        dq4, dk4 = dq.view(h, a_n, n, d), dk.view(h, b_n, m, d)
        krow_base = ((torch.arange(h, device=dev).view(h, 1, 1, 1) * b_n + torch.arange(b_n, device=dev)) * m)
        ca = max(1, min(hi - lo, budget // (h * max(n, m) * b_n * d)))
        scratch = torch.empty(h * ca * max(n, m) * b_n, d, device=dev, dtype=qf.dtype)
        for a0 in range(lo, hi, ca):
            a1 = min(a0 + ca, hi)
            c = a1 - a0
            if w1 is not None:  # t2v: query token (a, l) won key token (b, idx1[a, l, b]) of each key item b
                krow = (krow_base + idx1[:, a0:a1].long()).reshape(-1)  # rows of k_rows, [h, c, N, B]
                kg = torch.index_select(k_rows, 0, krow, out=scratch[:krow.numel()]).view(h, c, n, b_n, d)
                wa = w1[:, a0:a1]  # [h, c, B]
                dq4[:, a0:a1] += torch.matmul(wa.view(h, c, 1, 1, b_n), kg).view(h, c, n, d)
                src = torch.mul(qf[:, a0:a1].unsqueeze(3), wa.view(h, c, 1, b_n, 1), out=kg)  # w[b]·q[a, l]
                dk.index_add_(0, krow, src.view(-1, d))
            if w2 is not None:  # v2t: key token (b, m) won query token (a, idx2[a, b, m])
                arows = (torch.arange(h, device=dev).view(h, 1, 1, 1) * a_n
                         + torch.arange(a0, a1, device=dev).view(1, c, 1, 1)) * n
                qrow = (arows + idx2[:, a0:a1].long()).reshape(-1)  # [h, c, B, M]
                qg = torch.index_select(q_rows, 0, qrow, out=scratch[:qrow.numel()]).view(h, c, b_n, m, d)
                wa = w2[:, a0:a1].view(h, c, b_n, 1, 1)
                dk4 += torch.einsum("hcbmd,hcb->hbmd", qg, w2[:, a0:a1])  # Σ_a w[a, b]·q[a, winner]
                src = torch.mul(kf.unsqueeze(1), wa, out=qg)  # w[a, b]·k[b, m]
                dq.index_add_(0, qrow, src.view(-1, d))


def token_matching(q: torch.Tensor, k: torch.Tensor, chunk_elements: int | None = None):
    """Per-head token-wise maximum similarities of every query item with every key item.

    ``q`` [A, h, N, d], ``k`` [B, h, M, d] -> ``(t2v, v2t)``, each [A, B, h] (float32):
    ``t2v[a, b, h] = mean_l max_m q[a,h,l]·k[b,h,m]`` and ``v2t[a, b, h] = mean_m max_l q[a,h,l]·k[b,h,m]``.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"token_matching: q {tuple(q.shape)} and k {tuple(k.shape)} must be [A, h, N, d] and [B, h, M, d]")
    dev = q.device.type
    if dev == "cpu":
        # At least float32 on a CPU, also under bf16 autocast: the C kernels are float32, the products are a
        # small part of the step there, and bf16 similarities would tie far more often.
        dtype = torch.promote_types(q.dtype, torch.float32)
    else:
        # Under autocast the products run in the autocast dtype; cast here so that the backward pass (which
        # autocast does not reach) recomputes exactly the forward's similarities.
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype
    q, k = q.transpose(0, 1).to(dtype).contiguous(), k.transpose(0, 1).to(dtype).contiguous()
    with torch.autocast(dev, enabled=False):
        t2v, v2t = _TokenMax.apply(q, k, chunk_elements)
    return t2v.permute(1, 2, 0), v2t.permute(1, 2, 0)


def multihead_token_matching(q: torch.Tensor, k: torch.Tensor, chunk_elements: int | None = None,
                             per_head: bool = True) -> torch.Tensor:
    """MTM (Eqs. 2-3): ``[A, B]`` similarities, (t2v + v2t) / 2 averaged over the heads.

    ``per_head=False`` computes what the official code computes instead: the heads' dot products summed
    before the max, i.e. single-head matching of the concatenated vectors (for comparisons only).
    """
    if not per_head:
        q = q.transpose(1, 2).reshape(q.shape[0], 1, q.shape[2], -1)
        k = k.transpose(1, 2).reshape(k.shape[0], 1, k.shape[2], -1)
    t2v, v2t = token_matching(q, k, chunk_elements)
    return ((t2v + v2t) / 2).mean(-1)


def naive_multihead_token_matching(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The same as ``multihead_token_matching`` through the full similarity tensor (tests, benchmarks)."""
    s = torch.einsum("ahld,bhmd->abhlm", q, k)
    return ((s.max(-1).values.mean(-1) + s.max(-2).values.mean(-1)) / 2).mean(-1)


def info_nce(logits: torch.Tensor) -> torch.Tensor:
    """InfoNCE over a batch: row i's positive is column i, the other columns are its negatives.
    ``-mean_i log softmax(logits[i])[i]`` (the official ``CrossEn``)."""
    if logits.dim() != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"info_nce needs a square similarity matrix, got {tuple(logits.shape)}")
    target = torch.arange(logits.shape[0], device=logits.device)
    return F.cross_entropy(logits.float(), target)


def info_nce_both_ways(sim_ab: torch.Tensor, sim_ba: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of the two InfoNCE directions: rows of ``sim_ab`` (a→b) and rows of ``sim_ba`` (b→a).

    ``sim_ba`` defaults to ``sim_ab.T``, i.e. the columns of one matrix (CBR, CCR's Eq. 14).
    """
    return (info_nce(sim_ab) + info_nce(sim_ab.t() if sim_ba is None else sim_ba)) / 2
