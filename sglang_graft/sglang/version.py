"""The one SGLang version this plugin is written against, and the check that enforces it.

The plugin subclasses SGLang internals (the EAGLE V2 worker, its verify input) and hooks
dotted paths; any other SGLang release may move them silently. The pin lives in one
place, the ``sglang`` extra of ``pyproject.toml``; it is read back here from the
installed package metadata so the version string is never written twice.
"""

from __future__ import annotations

import os
from importlib import metadata

from packaging.requirements import InvalidRequirement, Requirement

DIST_NAME = "sglang-graft"
#: Set to ``1`` to load the plugin on an SGLang other than the pinned one (at your risk).
OVERRIDE_ENV = "SGLANG_GRAFT_ALLOW_ANY_SGLANG"


class SGLangVersionError(RuntimeError):
    """The installed SGLang is not the version the plugin is pinned to."""


def pinned_sglang_version(requirements: list[str] | None = None) -> str:
    """The exact SGLang version of the ``sglang`` extra (``sglang==X`` in pyproject.toml).

    Args:
        requirements: requirement strings to search (default: this distribution's
            installed metadata).
    """
    reqs = metadata.requires(DIST_NAME) if requirements is None else requirements
    for text in reqs or ():
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue
        if req.name.lower() != "sglang":
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if len(pins) != 1 or len(req.specifier) != 1:
            raise SGLangVersionError(
                f"{DIST_NAME}'s sglang requirement must be one exact pin (sglang==X), got {text!r}"
            )
        return pins[0]
    raise SGLangVersionError(f"{DIST_NAME} declares no sglang requirement; reinstall it with its 'sglang' extra")


def check_sglang_version(installed: str | None = None, pinned: str | None = None) -> str:
    """Raise ``SGLangVersionError`` unless the installed SGLang is the pinned one.

    ``SGLANG_GRAFT_ALLOW_ANY_SGLANG=1`` turns the error into a pass. Returns the
    installed version.
    """
    installed = metadata.version("sglang") if installed is None else installed
    pinned = pinned_sglang_version() if pinned is None else pinned
    if installed != pinned and os.environ.get(OVERRIDE_ENV) != "1":
        raise SGLangVersionError(
            f"sglang-graft is pinned to sglang=={pinned} but sglang=={installed} is installed; "
            f"install sglang=={pinned} (pip install 'sglang-graft[sglang]'), or set {OVERRIDE_ENV}=1 "
            "to load the plugin anyway"
        )
    return installed
