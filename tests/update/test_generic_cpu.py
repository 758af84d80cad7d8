"""SmartUpdate and SmartComp on a CPU that LLVM calls ``generic``, reproduced on any CPU with CPUID faulting.

PyPI's PoCL (pocl-binary-distribution 3.0, LLVM 14) hands LLVM's name for the host CPU to its compiler as
``-target-cpu``; on a CPU that LLVM 14 does not know (e.g. an AMD Zen 5 EPYC) that name is ``generic`` and every
kernel fails to build. ``cpuid_family.c`` makes every process of a test see such a CPU, so these tests fail on any
machine where the product would fail on that one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).with_name("cpuid_family.c")
NO_FAULTING = 77  # the shim's exit status where the CPU (or hypervisor) offers no CPUID faulting


@pytest.fixture(scope="module")
def generic_cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose processes see CPUID family 0x1A, which PoCL's LLVM 14 calls ``generic``."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the CPUID shim")
    library = tmp_path_factory.mktemp("cpuid") / "cpuid_family.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(library), str(SHIM)], check=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONFAULTHANDLER"}  # it owns SIGSEGV
    env["LD_PRELOAD"] = str(library)
    probe = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True)
    if probe.returncode == NO_FAULTING:
        pytest.skip("this CPU or hypervisor offers no CPUID faulting (arch_prctl ARCH_SET_CPUID)")
    assert probe.returncode == 0, probe.stderr
    return env


def wheel_icd() -> Path:
    """The ICD file of the PoCL that pyopencl's wheel ships (pocl-binary-distribution)."""
    import pyopencl

    icd = Path(pyopencl.__file__).parent / ".libs" / "pocl.icd"
    if not icd.is_file():
        pytest.skip(f"this pyopencl ships no PoCL ({icd} absent)")
    return icd


def wheel_pocl_first(env: dict[str, str], directory: Path) -> dict[str, str]:
    """``env`` with the OpenCL loader listing the wheel's PoCL before the system's ICDs (/etc/OpenCL/vendors), so
    the one that fails comes first and set-up must look further."""
    icd = wheel_icd()
    directory.mkdir()
    (directory / "0-wheel.icd").write_text(str(icd.parent / icd.read_text().strip()) + "\n")
    for system in sorted(Path("/etc/OpenCL/vendors").glob("*.icd")):
        shutil.copy(system, directory / f"1-{system.name}")
    return {**env, "OCL_ICD_VENDORS": str(directory)}


OPEN_DEVICE = """
import json, torch
from lightning_smartinf.errors import SetupError
from lightning_smartinf.update.opencl import DeviceSpec, candidate_devices, open_device
try:
    device, _, _ = open_device(DeviceSpec(), torch.float32, torch.float32)
    platforms = [d.platform.version for d in candidate_devices(DeviceSpec())]
    print(json.dumps({"device": device.name, "platform": device.platform.version, "candidates": platforms}))
except SetupError as err:
    print(json.dumps({"error": str(err)}))
"""


def open_device_in(env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run([sys.executable, "-c", OPEN_DEVICE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_wheels_pocl_alone_fails_with_one_line_that_names_the_fix(generic_cpu: dict[str, str]) -> None:
    """The failure mode itself: PyPI's PoCL cannot build on such a CPU, and set-up says what to install or set."""
    opened = open_device_in({**generic_cpu, "OCL_ICD_VENDORS": str(wheel_icd())})
    assert "error" in opened, f"the shim did not reproduce a generic CPU: {opened}"
    message = opened["error"]
    assert "\n" not in message and "no OpenCL device builds optimizers.cl" in message
    assert "apt-get install pocl-opencl-icd" in message and "POCL_LLVM_CPU_NAME" in message


def test_set_up_passes_over_the_pocl_that_fails_to_one_that_builds(generic_cpu: dict[str, str],
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """Debian's PoCL (pocl-opencl-icd, installed by .ci/run) targets the CPU by its features and builds there."""
    opened = open_device_in(wheel_pocl_first(generic_cpu, tmp_path / "vendors"))
    assert "device" in opened, opened["error"]
    wheel = opened["candidates"][0]
    assert "PoCL 3.0" in wheel and opened["platform"] != wheel, opened


def test_smart_update_and_smartcomp_train_on_a_generic_cpu(generic_cpu: dict[str, str], tmp_path: Path) -> None:
    """``update=smart`` end to end on two near-storage devices, with SmartComp, as a user runs it there."""
    cmd = [
        sys.executable, "-m", "lightning_smartinf.cli.train", "update=smart", "update.devices=2", "offload.grads=cpu",
        "compression=topk", "trainer.max_steps=3", "trainer.limit_val_batches=1", "offload.host_memory_budget=0",
        f"trainer.output_dir={tmp_path / 'runs'}", f"offload.nvme_path={tmp_path / 'state'}",
    ]  # fmt: skip
    env = wheel_pocl_first(generic_cpu, tmp_path / "vendors")
    env.pop("POCL_DEVICES", None)  # the run asks for two
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["summary"]["optimizer_steps"] == 3
    traffic = json.dumps(summary["summary"])
    assert "device0" in traffic and "device1" in traffic, traffic[:2000]
