"""The C kernels of token-wise matching against the pure-torch path and the naive formula (float32, CPU)."""

import warnings

import pytest
import torch

from pipeline.models import token_matching as tm
from pipeline.models import token_matching_native as native
from pipeline.models.token_matching import multihead_token_matching, naive_multihead_token_matching, token_matching

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def _inputs(seed, a=5, b=6, h=3, n=21, m=37, d=8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(a, h, n, d, generator=g, requires_grad=True)
    k = torch.randn(b, h, m, d, generator=g, requires_grad=True)
    w = torch.randn(a, b, generator=g)
    return q, k, w


def _value_and_grads(fn, q, k, w):
    out = fn(q, k)
    return (out.detach(), *torch.autograd.grad((out * w).sum(), (q, k)))


def _use(monkeypatch, lib):
    """Route token_matching through ``lib`` (None: the pure-torch path)."""
    monkeypatch.setattr(tm, "_native", lambda q, idx_dtype: lib if (q.dtype == torch.float32 and
                                                                    idx_dtype == torch.int16) else None)


@pytest.fixture(scope="module", params=["native", "generic"])
def kernels(request, tmp_path_factory):
    """The kernels as built for this CPU (AVX-512 path where it has it) and without -march (generic vectors)."""
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler on this machine")
    flags = native.FLAG_SETS[0] if request.param == "native" else native.FLAG_SETS[-1]
    return native.build(cc, flags, tmp_path_factory.mktemp(request.param))


# m = 37 and 196: key counts that are not multiples of the 16-lane vectors; n = 3 < 16 lanes.
@pytest.mark.parametrize("shape", [dict(n=21, m=37), dict(n=3, m=5), dict(n=196, m=196, d=4, a=3, b=2)])
@pytest.mark.parametrize("chunk", [None, 1, 500])
@pytest.mark.parametrize("threads", [1, 3])
def test_kernels_equal_the_torch_path_and_the_naive_formula(kernels, shape, chunk, threads, monkeypatch):
    q, k, w = _inputs(0, **shape)
    real = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    try:
        _use(monkeypatch, kernels)
        got = _value_and_grads(lambda a, b: multihead_token_matching(a, b, chunk), q, k, w)
        _use(monkeypatch, None)
        torch_path = _value_and_grads(lambda a, b: multihead_token_matching(a, b, chunk), q, k, w)
    finally:
        torch.set_num_threads(real)
    naive = _value_and_grads(naive_multihead_token_matching, q, k, w)
    for x, y, z in zip(got, torch_path, naive):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
        assert torch.allclose(x, z, rtol=1e-5, atol=1e-6)


def test_kernels_break_ties_like_torch_max(kernels, monkeypatch):
    # Integer-valued tokens: exact products and many exact ties in rows and columns, across vector lanes
    # (m = 40 spans two full 16-lane vectors and a tail).
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-1, 2, (3, 2, 33, 2), generator=g).float().requires_grad_(True)
    k = torch.randint(-1, 2, (4, 2, 40, 2), generator=g).float().requires_grad_(True)
    w = torch.randn(3, 4, generator=g)
    _use(monkeypatch, kernels)
    got = _value_and_grads(multihead_token_matching, q, k, w)
    want = _value_and_grads(naive_multihead_token_matching, q, k, w)
    assert torch.equal(got[0], want[0])
    for x, y in zip(got[1:], want[1:]):
        assert torch.allclose(x, y, atol=1e-6)


def test_kernel_backward_of_one_direction_only(kernels, monkeypatch):
    # Only t2v (or only v2t) reaches the loss: the other incoming gradient is None.
    q, k, _ = _inputs(1)
    _use(monkeypatch, kernels)
    for pick in (0, 1):
        got = torch.autograd.grad(token_matching(q, k)[pick].sum(), (q, k))
        s = torch.einsum("ahld,bhmd->abhlm", q, k)
        naive = s.max(-1).values.mean(-1) if pick == 0 else s.max(-2).values.mean(-1)
        want = torch.autograd.grad(naive.sum(), (q, k))
        for x, y in zip(got, want):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_it_warns_once_and_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("IDC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    with pytest.warns(UserWarning, match="pure-torch path"):
        assert native.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load() is None  # decided once per process
    q, k, w = _inputs(2)
    got = _value_and_grads(multihead_token_matching, q, k, w)  # the torch path
    want = _value_and_grads(naive_multihead_token_matching, q, k, w)
    for x, y in zip(got, want):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)


@needs_cc
def test_build_is_cached_per_source_flags_and_cpu(tmp_path):
    cc = native.compiler()
    native.build(cc, native.FLAG_SETS[-1], tmp_path)
    built = list(tmp_path.glob("token_matching-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.build(cc, native.FLAG_SETS[-1], tmp_path)  # found, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp
    native.build(cc, native.FLAG_SETS[0], tmp_path)  # other flags: another library beside it
    assert len(list(tmp_path.glob("token_matching-*.so"))) == 2
    assert not list(tmp_path.glob("*.tmp*")) and len(list(tmp_path.iterdir())) == 2  # no half-written files


def test_matching_stays_float32_under_cpu_bf16_autocast():
    q, k, w = _inputs(3)
    want = _value_and_grads(multihead_token_matching, q, k, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _value_and_grads(multihead_token_matching, q, k, w)
    assert got[0].dtype == torch.float32
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_kernel_results_do_not_depend_on_the_thread_count(kernels, monkeypatch):
    q, k, w = _inputs(5, a=7, b=9, n=30, m=41)
    _use(monkeypatch, kernels)
    real = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3, 5):
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            runs.append(_value_and_grads(lambda a, b: multihead_token_matching(a, b, 200), q, k, w))
    finally:
        torch.set_num_threads(real)
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            assert torch.equal(x, y)
