"""vidattn and vidattn.integrations.diffusers import without diffusers; using the integration
without it raises an ImportError that names the pinned version. Runs in a subprocess that
blocks the diffusers import, so it holds whether or not diffusers is installed here."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import vidattn

# The vidattn this test session imported (a source tree with its built library, or the
# installed package): the subprocess must load the same one.
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(vidattn.__file__)))


def test_integration_imports_without_diffusers():
    code = textwrap.dedent("""
        import sys
        sys.modules["diffusers"] = None  # any "import diffusers" now raises ImportError
        import torch, vidattn
        import vidattn.integrations.diffusers as vd
        assert "diffusers" not in [m for m in sys.modules if sys.modules[m] is not None]
        try:
            vd.enable(torch.nn.Linear(2, 2))
        except ImportError as e:
            assert "diffusers==0.42.1" in str(e), e
            print("ok")
        else:
            raise AssertionError("enable without diffusers did not raise")
    """)
    env = dict(os.environ, PYTHONPATH=os.path.abspath(PYTHON_DIR) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")
