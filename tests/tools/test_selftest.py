"""mask_replay.selftest on the CPU: the quick matrix passes against the float64 references, a wrong
kernel result is reported as a mismatch naming its case, and the references get the semantics right
on hand-made rows."""
import math

import pytest
import torch

import mask_replay
from mask_replay.tools import reference as ref
from mask_replay.tools import selftest as st

ALL_OPS = {"capture", "capture_fixed", "replay_fwd", "replay_bwd", "full_fwd", "full_bwd", "kept_mass",
           "hidden_fwd", "hidden_bwd", "sparse_grad"}


class Broken:
    """torch.ops.mask_replay with one op's result passed through `spoil`."""

    def __init__(self, op, spoil):
        self.op, self.spoil = op, spoil

    def __getattr__(self, name):
        real = getattr(torch.ops.mask_replay, name)
        return (lambda *args: self.spoil(real(*args))) if name == self.op else real


@pytest.fixture(scope="module")
def quick():
    return mask_replay.selftest("cpu", quick=True)


def test_quick_cpu_matrix_passes_against_the_references(quick):
    assert quick.device == "cpu" and quick.expectation == "float64 references"
    assert quick.ok, [(c.name, c.detail) for c in quick.failures]
    assert {c.op for c in quick.cases} == ALL_OPS
    names = " | ".join(c.name for c in quick.cases)
    for needle in ("greedy", "top_k=50", "top_p=0.999", "per-row mix", "ties", "neg_inf", "flat", "bf16", "fp16",
                   "fallback", "wide supports", "hot token"):
        assert needle in names, needle
    assert sum(row["cases"] for row in quick.by_op().values()) == len(quick.cases)


@pytest.mark.parametrize("op, spoil, needle", [
    ("kept_mass", lambda m: m * (1 + 1e-5), "kept_mass"),
    ("replay_fwd", lambda out: (out[0] - 1e-5, out[1], out[2]), "logp"),
    ("replay_bwd", lambda g: torch.cat([g[:1] * 1.01, g[1:]]), "grad"),
    ("full_fwd", lambda out: (out[0], out[1] + 1e-5), "lse"),
    ("hidden_bwd", lambda out: (out[0], out[1] * 1.001, out[2]), "grad weight"),
    ("hidden_fwd", lambda out: (out[0] + 1e-3, out[1], out[2]), "logp"),
    ("capture", lambda out: (out[0][:-1], torch.cat([out[1][:-1], out[1][-1:] - 1]), out[2]), "row"),
    ("capture_fixed", lambda out: (out[0], out[1] + 1, out[2]), "counts"),
])
def test_a_wrong_kernel_result_is_a_mismatch(monkeypatch, op, spoil, needle):
    monkeypatch.setattr(st, "KERNELS", Broken(op, spoil))
    shape = "12x16 -> 300" if op.startswith("hidden") else "6x1000"
    result = st.selftest("cpu", quick=True, only=f"{op} {shape} fp32")
    assert result.cases and not result.ok
    own = [c for c in result.cases if c.op == op]
    assert own and all(c.status == "mismatch" for c in own), [(c.name, c.status, c.detail) for c in own]
    assert all(needle in c.detail for c in own), [c.detail for c in own]


def test_a_raising_op_is_an_error_and_the_run_goes_on(monkeypatch):
    def boom(_):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(st, "KERNELS", Broken("full_bwd", boom))
    result = st.selftest("cpu", quick=True, only="6x1000")
    errors = [c for c in result.cases if c.status == "error"]
    assert [c.op for c in errors] == ["full_bwd", "full_bwd"] and "kernel exploded" in errors[0].detail
    assert result.stopped_at is None and not result.ok
    assert any(c.op == "full_fwd" and c.ok for c in result.cases)  # cases after the error still ran


def device_run_on_the_cpu(only=None):
    """The device path (kernels against the CPU kernels) with the CPU standing in for the device:
    the GPU branch of every check runs here, on the quick CPU shapes."""
    result = st.SelftestResult("cpu", "CPU kernels", True, False)
    return st.run_cases(st.Target(torch.device("cpu"), against_cpu=True), st.MATRICES[("cpu", True)], result,
                        only=only)


def test_the_device_path_of_every_check_runs():
    result = device_run_on_the_cpu()
    assert result.ok, [(c.name, c.detail) for c in result.failures]
    assert {c.op for c in result.cases} == ALL_OPS


def test_the_device_path_reports_a_wrong_result(monkeypatch):
    calls = {"n": 0}

    def second_call_differs(out):  # the device side runs first, then the CPU side: spoil one of them
        calls["n"] += 1
        return out * (1 + 1e-5) if calls["n"] % 2 else out

    monkeypatch.setattr(st, "KERNELS", Broken("kept_mass", second_call_differs))
    result = device_run_on_the_cpu(only="kept_mass 6x1000 fp32")
    assert result.cases and all(c.status == "mismatch" and "kept_mass" in c.detail for c in result.cases)


def test_a_cuda_error_stops_the_device_run_and_names_the_case(monkeypatch):
    def sticky(_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(st, "KERNELS", Broken("replay_bwd", sticky))
    result = device_run_on_the_cpu()
    assert result.stopped_at == result.cases[-1].name and result.cases[-1].op == "replay_bwd"
    assert result.cases[-1].status == "error" and "illegal memory access" in result.cases[-1].detail
    ops = [c.op for c in result.cases]
    assert not result.ok and ops.count("replay_bwd") == 1 and "hidden_fwd" not in ops  # nothing ran after it


def test_the_device_matrices_reach_the_shapes_the_kernels_branch_on():
    full, quick = st.MATRICES[("device", False)], st.MATRICES[("device", True)]
    for shape in ((1, 151936), (1, 262144), (2048, 1000), (256, 151936)):
        assert shape in full.shapes and shape in quick.shapes
    assert set(full.dtypes) == {torch.float32, torch.bfloat16, torch.float16}
    assert set(full.configs) == set(st.CONFIGS) and any(hot for *_, hot in full.hidden)


def test_cuda_errors_are_recognised():
    assert st.is_cuda_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not st.is_cuda_error(RuntimeError("top_p must be in (0, 1] (row 3)"))


def test_devices():
    with pytest.raises(ValueError, match="only cpu and cuda"):
        st.selftest("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            st.selftest("cuda")
        assert st.resolve_device(None).type == "cpu"


def test_full_matrix_flat_rows_with_a_wide_top_p():
    result = st.selftest("cpu", only="flat top_p=0.999")
    assert result.cases and result.ok, [c.detail for c in result.failures]


# ---- the references on hand-made rows -------------------------------------------------------------
def support_of(row, **kw):
    strict, loose = ref.support(torch.tensor([row]), **kw)
    assert torch.equal(strict, loose)
    return torch.nonzero(strict[0])[:, 0].tolist()


def test_reference_top_k_keeps_ties_and_top_p_keeps_tie_groups_whole():
    assert support_of([1.0, 3.0, 2.0, 2.0, 0.0], top_k=2) == [1, 2, 3]
    third = math.log(0.3)
    assert support_of([math.log(0.4), third, third], top_p=0.5) == [0, 1, 2]
    assert support_of([math.log(0.5), math.log(0.3), math.log(0.2)], top_p=0.45) == [0]
    assert support_of([math.log(0.5), math.log(0.3), math.log(0.2)], top_p=0.55) == [0, 1]
    assert support_of([math.log(0.5), math.log(0.3), math.log(0.2)], top_p=0.85) == [0, 1, 2]


def test_reference_min_p_greedy_and_neg_inf():
    row = [0.0, math.log(0.5), math.log(0.1), float("-inf")]
    assert support_of(row, min_p=0.2) == [0, 1]
    assert support_of(row, min_p=1.0) == [0]
    assert support_of([1.0, 5.0, 5.0, 2.0], temperature=0.0) == [1]  # first index of the maximum
    assert support_of(row) == [0, 1, 2]


def test_reference_fixed_layout_and_replay():
    dense = torch.tensor([[False, True, False, True], [True, True, True, True], [False] * 4])
    ids, counts, overflow = ref.fixed_from_dense(dense, 3)
    assert ids.tolist() == [[1, 3, -1], [0, 1, 2], [-1, -1, -1]]
    assert counts.tolist() == [2, 4, 0] and overflow.tolist() == [False, True, False]
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3, dtype=torch.float64)
    logp, lse, status = ref.replay(x, dense, torch.tensor([1, 0, 2]))
    assert status.tolist() == [0, 0, 2]
    assert logp[0].item() == pytest.approx(1.0 - math.log(math.exp(1) + math.exp(3)))
    assert lse[2].item() == pytest.approx(math.log(sum(math.exp(v) for v in range(4))))  # empty: whole row
    g = ref.replay_grad(x, dense, torch.tensor([1, 0, 2]), 2.0, torch.ones(3))
    assert g[0, 0].item() == 0.0 and g.sum(1).abs().max().item() < 1e-12  # zero outside K; rows sum to 0
