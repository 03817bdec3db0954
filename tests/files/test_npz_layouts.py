"""Every array layout numpy writes into a .npz (C or Fortran order, stored or compressed, either
byte order, more than two dimensions) reads back the same rows chunk by chunk, and a Fortran-ordered
member is inflated once, not once per chunk (its rows are spread over the whole member)."""
import zipfile

import numpy as np
import pytest

from mask_replay.files.dumps import Dump

SHAPES = [(7, 5), (6, 3, 4), (1, 1), (0, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
@pytest.mark.parametrize("dtype", ["<f4", ">f4", "<f8", "<i8", ">i2"])
def test_every_layout_reads_the_same_rows(tmp_path, shape, order, save, dtype):
    a = np.arange(int(np.prod(shape))).reshape(shape)
    path = tmp_path / "d.npz"
    save(path, logits=np.asarray(a, dtype=dtype, order=order))
    with Dump(path) as d:
        chunks = [d.get("logits", i, i + 2).numpy() for i in range(0, shape[0], 2)]
        got = np.concatenate(chunks) if chunks else np.zeros((0,) + shape[1:])
        np.testing.assert_array_equal(got, a)
        np.testing.assert_array_equal(d.get("logits").numpy(), a)


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_member_is_inflated_once_whatever_its_order(tmp_path, monkeypatch, order):
    rows, cols, chunk = 400, 300, 10
    a = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    path = tmp_path / "d.npz"
    np.savez_compressed(path, logits=np.asarray(a, order=order))
    inflated = [0]
    real_read = zipfile.ZipExtFile.read

    def counting_read(self, n=-1):
        data = real_read(self, n)
        inflated[0] += len(data)
        return data

    with Dump(path) as d:
        monkeypatch.setattr(zipfile.ZipExtFile, "read", counting_read)
        got = np.concatenate([d.get("logits", i, i + chunk).numpy() for i in range(0, rows, chunk)])
    np.testing.assert_array_equal(got, a)
    assert inflated[0] <= 1.1 * a.nbytes + 4096, inflated[0] / a.nbytes
