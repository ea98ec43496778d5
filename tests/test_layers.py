"""The core's layer rule: it imports neither SGLang nor transformers (checked in a fresh
interpreter, since this test session has both loaded)."""

from __future__ import annotations

import subprocess
import sys

CORE = (
    "sglang_graft.candidates",
    "sglang_graft.tree",
    "sglang_graft.calibration",
    "sglang_graft.host_arrays",
    "sglang_graft.prune",
    "sglang_graft.graft",
    "sglang_graft.verify",
    "sglang_graft.cost",
    "sglang_graft.cost_meter",
    "sglang_graft.scheduler",
    "sglang_graft.compiled",
    "sglang_graft.retrieval",
)


def test_core_imports_neither_sglang_nor_transformers():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in CORE)
        + "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'transformers')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"the core pulled in: {run.stdout.strip()}"
