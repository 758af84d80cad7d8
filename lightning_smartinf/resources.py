"""Locates the config tree, recipes and OpenCL kernels in a source checkout or an installed wheel."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def asset_dir(name: str) -> Path:
    """Return the directory ``name`` (``conf``, ``recipes`` or ``fpga_kernels``).

    A source checkout (also an editable install) has it beside the package; a wheel carries a copy in ``_assets``.
    """
    for candidate in (_PACKAGE.parent / name, _PACKAGE / "_assets" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"lightning_smartinf: cannot find the '{name}' directory next to {_PACKAGE}")
