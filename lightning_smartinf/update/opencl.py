"""OpenCL near-storage devices: finding them, building the optimizer kernels, and clear errors when either fails.

Here the devices are PoCL CPU devices (``pyopencl[pocl]``; ``POCL_DEVICES="pthread pthread"`` exposes two). On a
SmartSSD the same kernels come from an xclbin built offline with Xilinx v++ and load through XRT's OpenCL platform
(``binary`` in a device entry); the code path is the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.errors import SetupError
from lightning_smartinf.resources import asset_dir

KERNEL_SOURCE = "optimizers.cl"
SPARSE_SOURCE = "sparse.cl"
DEFAULT_PLATFORM = "Portable Computing Language"
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
VECTOR_WIDTH = 8
"""Elements per work-item (VEC in the kernel source)."""
WORK_GROUP = 128


def launch_shape(numel: int) -> tuple[tuple[int], tuple[int]]:
    """Global and local sizes for ``numel`` elements: one work-item per vector, whole work-groups."""
    items = -(-numel // VECTOR_WIDTH)
    return (-(-items // WORK_GROUP) * WORK_GROUP,), (WORK_GROUP,)


INSTALL_HINT = 'install PoCL with `pip install "pyopencl[pocl]"` (a CPU OpenCL driver), or your vendor\'s ICD'


@dataclass
class DeviceSpec:
    """One near-storage device: an OpenCL device and the directory it owns."""

    platform: str = DEFAULT_PLATFORM
    """Substring of the OpenCL platform name."""
    device: int = 0
    """Index among that platform's devices."""
    path: str | None = None
    """Directory for this device's state; default: offload.nvme_path/device<k>."""
    binary: str | None = None
    """Prebuilt kernel binary (e.g. an xclbin from v++) to load instead of building the source."""


def ensure_pocl_devices(count: int) -> None:
    """Ask PoCL for ``count`` CPU devices unless the user chose POCL_DEVICES (read once, at first platform query)."""
    if count > 1 and "POCL_DEVICES" not in os.environ:
        os.environ["POCL_DEVICES"] = " ".join(["pthread"] * count)


def _platforms() -> list[Any]:
    import pyopencl as cl

    try:
        return list(cl.get_platforms())
    except cl.LogicError:  # no ICD at all
        return []


def describe_platforms() -> str:
    found = [f"{p.name}: {[d.name for d in p.get_devices()]}" for p in _platforms()]
    return "; ".join(found) if found else "no OpenCL platform"


def find_device(spec: DeviceSpec) -> Any:
    """The OpenCL device of ``spec``, or an error listing what exists and how to get more."""
    platforms = [p for p in _platforms() if spec.platform.lower() in p.name.lower()]
    if not platforms:
        raise SetupError(
            f"update=smart: no OpenCL platform matching {spec.platform!r}; found: {describe_platforms()}. "
            f"To run the kernels on this machine's CPU, {INSTALL_HINT}"
        )
    devices = platforms[0].get_devices()
    if not 0 <= spec.device < len(devices):
        raise SetupError(
            f"update=smart: platform {platforms[0].name!r} has {len(devices)} device(s), index {spec.device} does not "
            f'exist. PoCL exposes more CPU devices with POCL_DEVICES="{" ".join(["pthread"] * (spec.device + 1))}"'
        )
    return devices[spec.device]


def build_program(context: Any, device: Any, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                  binary: str | None, source_name: str = KERNEL_SOURCE) -> Any:  # fmt: skip
    """Build ``fpga_kernels/<source_name>`` for this device (or load a prebuilt binary), showing the log on failure.

    ``grad_dtype`` and ``param_dtype`` set GRAD_FORMAT/PARAM_FORMAT (the sparse kernels read VALUE_FORMAT from
    ``grad_dtype``)."""
    import pyopencl as cl

    options = [f"-DGRAD_FORMAT={FORMATS[grad_dtype]}", f"-DPARAM_FORMAT={FORMATS[param_dtype]}",
               f"-DVALUE_FORMAT={FORMATS[grad_dtype]}"]  # fmt: skip
    if binary is not None:
        data = Path(binary).read_bytes()
        try:
            return cl.Program(context, [device], [data]).build()
        except cl.Error as err:
            raise SetupError(
                f"update=smart: the kernel binary {binary} does not load on {device.name!r} (built for another device "
                f"or platform?): {err}"
            ) from err
    source = (asset_dir("fpga_kernels") / source_name).read_text()
    try:
        return cl.Program(context, source).build(options=options)
    except cl.Error as err:
        raise SetupError(f"update=smart: {source_name} failed to build on {device.name!r}:\n{err}") from err
