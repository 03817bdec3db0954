"""CUDA capture kernels against the CPU kernel (bit-identical supports) and the reference.

Every test needs a GPU (conftest skips the `cuda` marker without one)."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mask_replay
from mask_replay import capture_fixed
from mask_replay.params import expand_params

pytestmark = pytest.mark.cuda
ops = torch.ops.mask_replay
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def params(n, device, temperature=1.0, top_k=None, top_p=None, min_p=None):
    return expand_params(n, device, temperature, top_k, top_p, min_p)


def run(logits, device, logz=True, **kw):
    n = logits.shape[0]
    args = params(n, device, **kw)
    return ops.capture(logits.to(device), *args, logz)


def check_against_cpu(logits, **kw):
    """Runs both kernels; asserts identical CSR and close logz; returns the CUDA result on CPU."""
    ids_c, off_c, lz_c = run(logits.cpu(), "cpu", **kw)
    ids_g, off_g, lz_g = run(logits.cuda(), "cuda", **kw)
    assert ids_g.dtype == torch.int32 and off_g.dtype == torch.int64
    assert torch.equal(off_g.cpu(), off_c), "offsets differ"
    assert torch.equal(ids_g.cpu(), ids_c), "token ids differ"
    t = params(logits.shape[0], "cpu", **{k: v for k, v in kw.items() if k == "temperature"})[0]
    sampled_rows = t != 0  # greedy rows carry no meaningful logz
    torch.testing.assert_close(lz_g.cpu()[sampled_rows], lz_c[sampled_rows], rtol=1e-6, atol=1e-6)
    return ids_g.cpu(), off_g.cpu()


def dense(ids, offsets, v):
    n = offsets.numel() - 1
    rows = torch.repeat_interleave(torch.arange(n), offsets.diff())
    out = torch.zeros(n, v, dtype=torch.bool)
    out[rows, ids.long()] = True
    return out


def check_reference(logits, ids, offsets, **kw):
    from reference import reference_support

    n, v = logits.shape
    t, k, p, mp = params(n, "cpu", **kw)
    strict, loose = reference_support(logits.cpu(), t, k, p, mp)
    d = dense(ids, offsets, v)
    assert bool((strict <= d).all()), "support misses a token the reference requires"
    assert bool((d <= loose).all()), "support holds a token the reference excludes"


def check_csr(ids, offsets, v):
    assert int(offsets[0]) == 0 and int(offsets[-1]) == ids.numel()
    assert bool((offsets.diff() >= 0).all())
    for r in range(offsets.numel() - 1):
        row = ids[int(offsets[r]):int(offsets[r + 1])].long()
        assert bool((row.diff() > 0).all()) and (row.numel() == 0 or (0 <= int(row.min()) and int(row.max()) < v))


CONFIGS = [
    dict(),
    dict(top_p=0.95),
    dict(top_k=50),
    dict(min_p=0.1),
    dict(top_k=50, top_p=0.9, min_p=0.05, temperature=0.7),
    dict(top_p=0.5, temperature=1.3),
    dict(temperature=0.0),
]
SHAPES = [(1, 1), (1, 1000), (7, 1000), (7, 32000), (1, 151936), (64, 151936), (1, 262144), (7, 262144),
          (1024, 1000), (1024, 32000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "none")
def test_matches_cpu(shape, dtype, cfg):
    g = torch.Generator().manual_seed(shape[0] * 1_000_003 + shape[1] * 7 + DTYPES.index(dtype))
    logits = (torch.randn(shape, generator=g) * 4).to(dtype)
    ids, offsets = check_against_cpu(logits, **cfg)
    check_csr(ids, offsets, shape[1])
    if shape[0] * shape[1] <= 8_000_000:
        check_reference(logits, ids, offsets, **cfg)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_everywhere(dtype):
    g = torch.Generator().manual_seed(1)
    # few distinct values in bf16/fp16: huge tie groups at every threshold
    logits = torch.randint(-4, 5, (16, 5000), generator=g).to(dtype) * 0.5
    for cfg in (dict(top_k=1), dict(top_k=7), dict(top_p=0.3), dict(top_p=0.999), dict(min_p=0.5),
                dict(top_k=100, top_p=0.5)):
        ids, offsets = check_against_cpu(logits, **cfg)
        check_reference(logits, ids, offsets, **cfg)


def test_all_equal_rows():
    logits = torch.full((4, 70000), 1.25)
    for cfg in (dict(top_k=1), dict(top_p=0.01), dict(min_p=1.0), dict()):
        ids, offsets = check_against_cpu(logits, **cfg)
        assert offsets.diff().tolist() == [70000] * 4  # every token ties with the top one
    ids, offsets = check_against_cpu(logits, temperature=0.0)
    assert ids.tolist() == [0, 0, 0, 0]  # greedy: first index of the max


def test_ties_at_kth_value():
    row = torch.linspace(-5, 0, 4000)
    row[100:110] = 2.0  # ten-way tie for 3rd..12th place
    row[7] = 3.0
    row[9] = 4.0
    logits = row.repeat(3, 1)
    ids, offsets = check_against_cpu(logits, top_k=torch.tensor([3, 2, 12]))
    assert offsets.diff().tolist() == [12, 2, 12]


def test_top_p_boundary_tie():
    # two equal tokens straddle p: the whole tie group stays
    logits = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.3)]])
    ids, _ = check_against_cpu(logits, top_p=0.5)
    assert ids.tolist() == [0, 1, 2]


def test_neg_inf_entries():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 40000, generator=g)
    logits[:, ::3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, 5] = 1.0  # a single finite token
    for cfg in (dict(), dict(top_p=0.9), dict(top_k=30000), dict(min_p=0.2)):
        ids, offsets = check_against_cpu(logits, **cfg)
        assert not bool((ids % 3 == 0).any())


def test_mixed_rows_and_edge_params():
    g = torch.Generator().manual_seed(3)
    n, v = 9, 20000
    logits = torch.randn(n, v, generator=g) * 3
    t = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 0.0, 1.0, 1.0, 1e-3])
    k = torch.tensor([0, 5, 50, v + 10, 1, 0, v, 3, 0])
    p = torch.tensor([1.0, 0.9, 0.95, 0.5, 1.0, 1.0, 0.3, 1.0, 0.99], dtype=torch.float64)
    mp = torch.tensor([0.0, 0.0, 0.1, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64)
    ids, offsets = check_against_cpu(logits, temperature=t, top_k=k, top_p=p, min_p=mp)
    check_reference(logits, ids, offsets, temperature=t, top_k=k, top_p=p, min_p=mp)
    assert offsets.diff()[4] == 1 and offsets.diff()[0] == v  # k=1 row; untruncated row


@pytest.mark.parametrize("n", [1, 7, 64])
def test_top_k_larger_than_vocab_and_limits(n):
    logits = torch.randn(n, 1000)
    ids, offsets = check_against_cpu(logits, top_k=5000, top_p=1.0)
    assert offsets.diff().tolist() == [1000] * n
    ids, offsets = check_against_cpu(logits, min_p=1.0)
    assert offsets.diff().tolist() == [1] * n


def test_empty_inputs():
    ids, offsets, lz = run(torch.empty(0, 100), "cuda")
    assert ids.numel() == 0 and offsets.tolist() == [0] and lz.numel() == 0
    with pytest.raises(RuntimeError, match="row 0 has no finite logit"):
        run(torch.empty(3, 0), "cuda")


@st.composite
def cases(draw):
    n = draw(st.integers(1, 6))
    v = draw(st.sampled_from([1, 2, 17, 300, 2048, 5000, 40000]))
    dtype = draw(st.sampled_from(DTYPES))
    pattern = draw(st.sampled_from(["randn", "ints", "wide"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if pattern == "randn":
        logits = torch.randn(n, v, generator=g) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    elif pattern == "ints":
        logits = torch.randint(-3, 4, (n, v), generator=g).float()
    else:
        logits = torch.randn(n, v, generator=g) * 200
    if draw(st.booleans()):
        logits[torch.rand(n, v, generator=g) < 0.2] = float("-inf")
        logits[:, 0] = 0.0  # keep a finite value per row
    kw = {}
    kw["temperature"] = draw(st.sampled_from([1.0, 0.0, 0.3, 1.7]))
    kw["top_k"] = draw(st.sampled_from([None, 1, 2, 10, 1000]))
    kw["top_p"] = draw(st.sampled_from([None, 1.0, 0.999, 0.9, 0.5, 0.05]))
    kw["min_p"] = draw(st.sampled_from([None, 0.0, 0.01, 0.3, 1.0]))
    return logits.to(dtype), kw


@given(cases())
def test_property_matches_cpu_and_reference(case):
    logits, kw = case
    ids, offsets = check_against_cpu(logits, **kw)
    check_csr(ids, offsets, logits.shape[1])
    check_reference(logits, ids, offsets, **kw)


@pytest.mark.parametrize(
    "row_value,kw,message",
    [
        (float("nan"), {}, r"row 2 contains NaN \(column 1234\)"),
        (float("inf"), {}, r"row 2 contains \+inf \(column 1234\)"),
        (1e30, dict(temperature=1e-10), r"row 2 overflows to \+inf .*\(column 1234\)"),
        (None, {}, "row 2 has no finite logit"),
    ],
)
def test_errors_name_the_row(row_value, kw, message):
    logits = torch.randn(4, 3000)
    if row_value is None:
        logits[2] = float("-inf")
    else:
        logits[2, 1234] = row_value
    with pytest.raises(RuntimeError, match=message):
        run(logits, "cuda", **kw)
    with pytest.raises(RuntimeError, match=message):  # same words as the CPU kernel
        run(logits, "cpu", **kw)


def test_first_defect_in_scan_order_is_reported():
    # the row is split over many blocks; the earliest column wins, whatever its kind
    logits = torch.randn(1, 151936)
    logits[0, 150000] = float("nan")
    logits[0, 90000] = float("inf")
    logits[0, 120000] = float("nan")
    for device in ("cuda", "cpu"):
        with pytest.raises(RuntimeError, match=r"row 0 contains \+inf \(column 90000\)"):
            run(logits, device)


def test_bad_parameter_rows_named():
    logits = torch.randn(3, 100, device="cuda")
    t, k, p, mp = params(3, "cuda")
    with pytest.raises(RuntimeError, match="top_p must be in .*row 1"):
        ops.capture(logits, t, k, torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64, device="cuda"), mp, False)
    with pytest.raises(RuntimeError, match="temperature .*row 2"):
        ops.capture(logits, torch.tensor([1.0, 1.0, -1.0], device="cuda"), k, p, mp, False)


# ---- capture_fixed ------------------------------------------------------------------------------

def fixed_from_csr(ids, offsets, width):
    n = offsets.numel() - 1
    out = torch.full((n, width), -1, dtype=torch.int32)
    for r in range(n):
        row = ids[int(offsets[r]):int(offsets[r + 1])][:width]
        out[r, : row.numel()] = row
    return out


@pytest.mark.parametrize("shape", [(1, 151936), (7, 32000), (64, 1000)], ids=str)
@pytest.mark.parametrize("width", [1, 20, 64, 4096])
def test_fixed_matches_csr(shape, width):
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(shape, generator=g) * 3).cuda()
    kw = dict(top_k=50, top_p=0.9)
    ids, offsets, _ = run(logits, "cuda", logz=False, **kw)
    fids, counts, overflow = capture_fixed(logits, width, **kw)
    assert fids.shape == (shape[0], width) and fids.dtype == torch.int32
    assert torch.equal(counts.cpu(), offsets.diff().cpu())
    assert torch.equal(overflow.cpu(), offsets.diff().cpu() > width)
    assert torch.equal(fids.cpu(), fixed_from_csr(ids.cpu(), offsets.cpu(), width))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fixed_matches_cpu_fixed(dtype):
    logits = (torch.randn(9, 32000) * 3).to(dtype)
    logits[2, 7] = float("nan")
    logits[5] = float("-inf")
    t = torch.tensor([1.0, 0.0, 1.0, 0.7, 1.0, 1.0, -1.0, 1.0, 1.0])  # row 6: bad temperature
    k = torch.tensor([0, 0, 5, 40, 0, 0, 0, 1, 100])
    p = torch.tensor([0.9, 1.0, 1.0, 0.95, 1.0, 1.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    mp = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    cpu = ops.capture_fixed(logits, t, k, p, mp, 48)
    gpu = ops.capture_fixed(logits.cuda(), t.cuda(), k.cuda(), p.cuda(), mp.cuda(), 48)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


def test_fixed_invalid_rows_flagged():
    logits = torch.randn(5, 1000, device="cuda")
    logits[1, 3] = float("nan")
    logits[3] = float("-inf")
    p = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.0], dtype=torch.float64, device="cuda")  # row 4: bad top_p
    ids, counts, overflow = capture_fixed(logits, 16, top_p=p)
    assert counts[[1, 3, 4]].tolist() == [-1, -1, -1]
    assert overflow[[1, 3, 4]].tolist() == [True, True, True]
    assert bool((ids[[1, 3, 4]] == -1).all())
    assert bool((counts[[0, 2]] > 0).all())


def test_fixed_does_not_sync():
    logits = torch.randn(8, 151936, device="cuda")
    t, k, p, mp = params(8, "cuda", temperature=0.8, top_k=40, top_p=0.9, min_p=0.02)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids, counts, overflow = ops.capture_fixed(logits, t, k, p, mp, 64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref, offsets, _ = ops.capture(logits, t, k, p, mp, False)
    assert torch.equal(counts, offsets.diff())
    assert torch.equal(ids.cpu(), fixed_from_csr(ref.cpu(), offsets.cpu(), 64))


def test_fixed_in_cuda_graph():
    n, v, width = 4, 32000, 128
    static = torch.randn(n, v, device="cuda")
    t, k, p, mp = params(n, "cuda", top_k=100, top_p=0.8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph, as graph capture requires
        ops.capture_fixed(static, t, k, p, mp, width)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.capture_fixed(static, t, k, p, mp, width)
    for seed in range(3):
        static.copy_(torch.randn(n, v, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        want = ops.capture_fixed(static, t, k, p, mp, width)
        for got, exp in zip(out, want):
            assert torch.equal(got, exp)


# ---- determinism, opcheck ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 64])
def test_run_to_run_identical(n):
    logits = torch.randn(n, 151936, device="cuda").to(torch.bfloat16)
    t, k, p, mp = params(n, "cuda", temperature=0.9, top_p=0.95)
    first = ops.capture(logits, t, k, p, mp, True)
    for _ in range(5):
        again = ops.capture(logits, t, k, p, mp, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)  # logz too: its partial sums are combined in a fixed order


def test_opcheck():
    logits = torch.randn(3, 5000, device="cuda")
    args = params(3, "cuda", top_k=20, top_p=0.9)
    torch.library.opcheck(ops.capture.default, (logits, *args, True))
    torch.library.opcheck(ops.capture.default, (logits, *args, False))
    torch.library.opcheck(ops.capture_fixed.default, (logits, *args, 32))


def test_python_api_on_cuda():
    logits = torch.randn(6, 3000, device="cuda")
    mask = mask_replay.capture(logits, top_p=0.9, top_k=100)
    cpu = mask_replay.capture(logits.cpu(), top_p=0.9, top_k=100)
    assert torch.equal(mask.token_ids.cpu(), cpu.token_ids) and torch.equal(mask.offsets.cpu(), cpu.offsets)
