"""OpenCL near-storage devices: finding them, building the optimizer kernels, and clear errors when either fails.

Here the devices are PoCL CPU devices (``pyopencl[pocl]``; ``POCL_DEVICES="pthread pthread"`` exposes two). On a
SmartSSD the same kernels come from an xclbin built offline with Xilinx v++ and load through XRT's OpenCL platform
(``binary`` in a device entry); the code path is the same.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_smartinf.errors import ConfigError, SetupError
from lightning_smartinf.extras import require
from lightning_smartinf.resources import asset_dir

KERNEL_SOURCE = "optimizers.cl"
SPARSE_SOURCE = "sparse.cl"
QUANT_SOURCE = "quant8.cl"
"""8-bit optimizer state's kernels (update/device_state.py)."""
_SIGNATURE = re.compile(r"__kernel\s+void\s+(\w+)\s*\(([^)]*)\)")


SMART_NEEDS = "update=smart (the near-storage devices run OpenCL)"

def kernel_signatures(source_name: str) -> dict[str, tuple[str, ...]]:
    """Each ``__kernel``'s parameter names, in order, as ``fpga_kernels/<source_name>`` declares them."""
    source = (asset_dir("fpga_kernels") / source_name).read_text()
    return {m.group(1): tuple(re.sub(r"[*\s]+", " ", arg).split()[-1] for arg in m.group(2).split(","))
            for m in _SIGNATURE.finditer(source)}  # fmt: skip


class NamedKernel:
    """A kernel called by argument name: the host's table of names is checked against the kernel's signature when
    the program is built, and each call is ordered by it, so host and kernel cannot drift apart by position."""

    def __init__(self, program: Any, name: str, source_name: str, arguments: tuple[str, ...]) -> None:
        declared = kernel_signatures(source_name).get(name)
        if declared != arguments:
            raise SetupError(
                f"update=smart: kernel {name} in fpga_kernels/{source_name} takes ({', '.join(declared or ())}) but "
                f"the host passes ({', '.join(arguments)}): change update/smart.py's KERNEL_ARGUMENTS with the kernel"
            )
        self.name, self.arguments, self.kernel = name, arguments, getattr(program, name)

    def __call__(self, queue: Any, global_size: tuple[int, ...], local_size: tuple[int, ...] | None,
                 **values: Any) -> Any:  # fmt: skip
        if values.keys() != set(self.arguments):
            missing, extra = set(self.arguments) - values.keys(), values.keys() - set(self.arguments)
            raise TypeError(f"kernel {self.name}: missing {sorted(missing)}, unexpected {sorted(extra)}")
        return self.kernel(queue, global_size, local_size, *(values[name] for name in self.arguments))
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
    cl = require("pyopencl", SMART_NEEDS)

    try:
        return list(cl.get_platforms())
    except cl.LogicError:  # no ICD at all
        return []


def describe_platforms() -> str:
    found = [f"{p.name}: {[d.name for d in p.get_devices()]}" for p in _platforms()]
    return "; ".join(found) if found else "no OpenCL platform"


def candidate_devices(spec: DeviceSpec) -> list[Any]:
    """Device ``spec.device`` of every platform matching ``spec.platform``, in the ICD loader's order, or an error
    listing what exists and how to get more. Several PoCL builds may be installed (the wheel's, Debian's): each is a
    candidate, since one may build kernels on a CPU where another cannot."""
    platforms = [p for p in _platforms() if spec.platform.lower() in p.name.lower()]
    if not platforms:
        raise SetupError(
            f"update=smart: no OpenCL platform matching {spec.platform!r}; found: {describe_platforms()}. "
            f"To run the kernels on this machine's CPU, {INSTALL_HINT}"
        )
    devices = [p.get_devices()[spec.device] for p in platforms if 0 <= spec.device < len(p.get_devices())]
    if not devices:
        counts = ", ".join(f"{p.name!r} {p.version!r}: {len(p.get_devices())}" for p in platforms)
        raise SetupError(
            f"update=smart: device index {spec.device} does not exist on any platform matching {spec.platform!r} "
            f"({counts}). "
            f'PoCL exposes more CPU devices with POCL_DEVICES="{" ".join(["pthread"] * (spec.device + 1))}"'
        )
    return devices


class KernelBuildError(SetupError):
    """A kernel source that one OpenCL device's compiler refused; ``log`` is the compiler's output."""

    def __init__(self, message: str, device: Any, log: str) -> None:
        super().__init__(message)
        self.device, self.log = device, log

    @property
    def unknown_cpu(self) -> bool:
        """PoCL passed LLVM's name for the host CPU and LLVM did not know it (``unknown target CPU 'generic'``)."""
        return "unknown target CPU" in self.log


GENERIC_CPU_HINT = (
    "the LLVM inside that PoCL does not know this CPU (it calls it 'generic'). Install a PoCL that targets the CPU "
    "by its features, e.g. `apt-get install pocl-opencl-icd` on Debian/Ubuntu (found beside the wheel's at the next "
    "start), or set POCL_LLVM_CPU_NAME=x86-64 for a PoCL 3.1 or newer built for one CPU"
)


def open_device(spec: DeviceSpec, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                source_name: str = KERNEL_SOURCE) -> tuple[Any, Any, Any]:  # fmt: skip
    """(device, context, program) on the first candidate device that builds ``fpga_kernels/<source_name>`` (or
    loads ``spec.binary``): building is the only test of a device that tells the truth, so each is tried in turn.
    Where none builds, one error says why and what to install or set."""
    import pyopencl as cl

    failures: list[KernelBuildError] = []
    for device in candidate_devices(spec):
        context = cl.Context([device])
        try:
            return device, context, build_program(context, device, grad_dtype, param_dtype, spec.binary, source_name)
        except KernelBuildError as err:
            failures.append(err)
    if all(f.unknown_cpu for f in failures):
        tried = "; ".join(f"{f.device.name!r} ({f.device.platform.version.split('  ')[0]})" for f in failures)
        raise SetupError(f"update=smart: no OpenCL device builds {source_name}: {tried}: {GENERIC_CPU_HINT}")
    raise next(f for f in failures if not f.unknown_cpu)


def build_program(context: Any, device: Any, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                  binary: str | None, source_name: str = KERNEL_SOURCE) -> Any:  # fmt: skip
    """Build ``fpga_kernels/<source_name>`` for this device (or load a prebuilt binary), showing the log on failure.

    ``grad_dtype`` and ``param_dtype`` set GRAD_FORMAT/PARAM_FORMAT (the sparse kernels read VALUE_FORMAT from
    ``grad_dtype``)."""
    import pyopencl as cl

    # correctly rounded division and square root, as the host's: with 8-bit state the host's fused update
    # (update/quant8.cpp) and the device's kernels then write the same bytes
    options = [f"-DGRAD_FORMAT={FORMATS[grad_dtype]}", f"-DPARAM_FORMAT={FORMATS[param_dtype]}",
               f"-DVALUE_FORMAT={FORMATS[grad_dtype]}", "-cl-fp32-correctly-rounded-divide-sqrt"]  # fmt: skip
    if binary is not None:
        data = Path(binary).read_bytes()
        try:
            return cl.Program(context, [device], [data]).build()
        except cl.Error as err:
            raise KernelBuildError(
                f"update=smart: the kernel binary {binary} does not load on {device.name!r} (built for another device "
                f"or platform?): {err}", device, str(err)
            ) from err
    source = (asset_dir("fpga_kernels") / source_name).read_text()
    try:
        return cl.Program(context, source).build(options=options)
    except cl.Error as err:
        raise KernelBuildError(f"update=smart: {source_name} failed to build on {device.name!r}:\n{err}", device,
                               str(err)) from err


def device_specs(devices: Any) -> list[DeviceSpec]:
    """``update.devices`` (a count or a list of mappings) as device specs; a count asks PoCL for that many."""
    if isinstance(devices, int):
        ensure_pocl_devices(devices)
        return [DeviceSpec(device=k) for k in range(devices)]
    specs = []
    for entry in devices:
        unknown = sorted(set(entry) - {"platform", "device", "path", "binary"})
        if unknown:
            raise ConfigError(f"update.devices entry has unknown keys {unknown}; valid: platform, device, path, binary")
        specs.append(DeviceSpec(**dict(entry)))
    ensure_pocl_devices(max(s.device for s in specs) + 1)
    return specs
