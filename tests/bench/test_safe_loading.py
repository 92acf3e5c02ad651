"""Files a user was handed never run pickled code when the harness loads them."""
from __future__ import annotations

import os
import pickle

import pytest
import torch

from impl.fisedit.cache import ActivationCache


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_cache_file_with_pickled_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "cache.pt"
    torch.save({"meta": _Evil(marker), "entries": {}, "skipped_steps": [], "budget_bytes": 0}, path)
    with pytest.raises(pickle.UnpicklingError):
        ActivationCache.load(path)
    assert not marker.exists()
