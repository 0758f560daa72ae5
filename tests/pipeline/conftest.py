"""What the tests of tests/pipeline/ share: the Ray head their prepares join."""

import pytest
from corpora import RayHead


@pytest.fixture(scope="module")
def ray_head():
    """A one-node Ray cluster of 2 CPUs for one test file's prepares (`corpora.RayHead`), stopped
    with its processes after the file's last test. test_prepare.py has its own, of 3 CPUs."""
    head = RayHead(num_cpus=2)
    yield head
    head.stop()
