import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import the references as plain modules

import mask_replay._ext  # noqa: E402,F401  (registers torch.ops.mask_replay for tests that use it directly)

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device here (CUDA kernels are compiled, not run)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# ---- CLI fixtures shared by test_cli*.py: a small rollout dump and its captured mask file ---------
@pytest.fixture
def rollout(tmp_path):
    from test_cli import rollout_tensors, write

    return write(tmp_path / "rollout.safetensors", rollout_tensors())


@pytest.fixture
def captured(tmp_path, rollout):
    from test_cli import run

    masks = tmp_path / "m.safetensors"
    result = run("capture", rollout, "-o", masks)
    assert result.exit_code == 0, result.output
    return str(masks)
