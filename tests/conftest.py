import atexit
import os
import shutil
import sys
import tempfile

import pytest

# Make the harness importable from every test module and keep the parent light on threads.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch.compile's inductor caches compiled kernels in one directory per user. Sessions under
# another ATEN_CPU_CAPABILITY (make test-kernels) sharing it failed to build kernels (C++
# errors on at::vec); each test session gets a cache of its own, inherited by its ranks.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shardtrain-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture
def lighthouse():
    """make(min_replicas=2, join_timeout_ms=10_000) -> torchft's Lighthouse in this process
    on the loopback address (tests/ft_harness.py), closed after the test."""
    from ft_harness import Lighthouse

    made = []

    def make(min_replicas: int = 2, join_timeout_ms: int = 10_000) -> Lighthouse:
        made.append(Lighthouse(min_replicas, join_timeout_ms))
        return made[-1]

    yield make
    for lh in made:
        lh.close()
