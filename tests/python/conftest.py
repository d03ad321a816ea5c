import os
import sys
import zlib

import pytest
import torch

# Test helper modules (attention_reference.py) sit next to the tests.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's own id: fresh inputs per test, reproducible."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
