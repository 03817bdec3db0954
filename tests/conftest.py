"""Suite-wide settings: hypothesis profiles, CUDA cases skipped without a GPU, the CLI fixtures.
Shared helpers and references live in tests/helpers.py."""
import os

import pytest
import torch
from hypothesis import settings

import mask_replay  # noqa: F401  (registers torch.ops.mask_replay for tests that call the ops directly)
from tests.helpers import rollout_tensors, run, write

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here (CUDA kernels are compiled, not run)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # not `in item.keywords`: that also matches folder names
            item.add_marker(skip)


# ---- CLI fixtures shared by tests/cli, tests/files, ...: a small rollout dump and its mask file ------
@pytest.fixture
def rollout(tmp_path):
    return write(tmp_path / "rollout.safetensors", rollout_tensors())


@pytest.fixture
def captured(tmp_path, rollout):
    masks = tmp_path / "m.safetensors"
    result = run("capture", rollout, "-o", masks)
    assert result.exit_code == 0, result.output
    return str(masks)
