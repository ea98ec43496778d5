"""Test-session setup.

SGLang ships Triton versions of its tree kernels; Triton's interpreter runs them on the CPU,
which lets the tests compare our PyTorch twins with SGLang's own code on this machine. The
variable must be set before Triton compiles anything, hence here.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
