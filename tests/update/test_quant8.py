"""8-bit optimizer state (update/quant8.py) against a plain-torch reference of the paper's algorithm written here:
the dynamic map decoded bit by bit, quantization to the nearest map value by brute force, and Adam on the widened
state; the host update with 8-bit state on disk and in RAM equals it over 20 steps."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from lightning_smartinf.core import MASTER, StepContext, Subgroup
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.storage.aligned import aligned_bytes, typed_view
from lightning_smartinf.storage.counters import TrafficCounters
from lightning_smartinf.storage.io import make_backend
from lightning_smartinf.storage.store import FileStore, HostStore, TieredStore
from lightning_smartinf.update import quant8
from lightning_smartinf.update.host import HostUpdater
from lightning_smartinf.update.optimizers import OptimizerRule, StateSpec

BLOCK = 2048


def decoded_map(signed: bool) -> torch.Tensor:
    """Each 8-bit code decoded: [sign], then zeros (a power of ten each), an indicator 1, and the remaining bits as
    a linear fraction of [0.1, 1] (the middle of its step); no indicator at all: 0. The one code left over (the
    sign's 'negative zero', or the unsigned code whose indicator is its last bit) stands for 1."""
    values = []
    width = 7 if signed else 8
    for code in range(256):
        negative = signed and bool(code >> 7)
        bits = code & ((1 << width) - 1)
        zeros = width - bits.bit_length()  # leading zeros before the indicator
        fraction_bits = width - zeros - 1
        if bits == 0:
            values.append(1.0 if negative else 0.0)
        elif not signed and fraction_bits == 0:
            values.append(1.0)
        else:
            f = bits & ((1 << fraction_bits) - 1)
            magnitude = 10.0**-zeros * (0.1 + 0.9 * (f + 0.5) / (1 << fraction_bits))
            values.append(-magnitude if negative else magnitude)
    return torch.tensor(sorted(values), dtype=torch.float32)


def reference_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax per block): the code of the map value nearest to x / absmax, the first one on a tie."""
    table = decoded_map(signed)
    codes, scales = [], []
    for start in range(0, x.numel(), BLOCK):
        block = x[start : start + BLOCK]
        absmax = block.abs().max()
        y = block / (absmax if absmax > 0 else torch.tensor(1.0))
        codes.append((table[None, :] - y[:, None]).abs().argmin(dim=1))  # argmin: the first of equal distances
        scales.append(absmax)
    return torch.cat(codes), torch.stack(scales)


def reference_dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    table = decoded_map(signed)
    return torch.cat([table[codes[i : i + BLOCK]] * scales[i // BLOCK] for i in range(0, codes.numel(), BLOCK)])


def reference_adamw(params: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float],
                    eps: float, weight_decay: float) -> torch.Tensor:  # fmt: skip
    """AdamW whose two moments are kept 8-bit between steps (widened, updated in torch's single-tensor order,
    quantized again)."""
    p = params.clone()
    m_q = reference_quantize(torch.zeros_like(p), True)
    v_q = reference_quantize(torch.zeros_like(p), False)
    for step, g in enumerate(grads, start=1):
        m, v = reference_dequantize(*m_q, True), reference_dequantize(*v_q, False)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - betas[0])
        v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
        step_size = lr / (1 - betas[0] ** step)
        denom = (v.sqrt() / math.sqrt(1 - betas[1] ** step)).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
        m_q, v_q = reference_quantize(m, True), reference_quantize(v, False)
    return p


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_map_is_the_bit_patterns_decoded(signed: bool) -> None:
    assert torch.equal(quant8.dynamic_map(signed), decoded_map(signed))


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "torch-ops"])
def test_quantize_picks_the_nearest_value_per_block(signed: bool, compiled: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The compiled kernel and the torch ops it falls back to, each against the brute-force reference."""
    assert quant8.kernel() is not None, "the kernel should build wherever the tests run (a C++ compiler is there)"
    if not compiled:
        monkeypatch.setattr(quant8, "kernel", lambda: None)
    torch.manual_seed(0)
    numel = 3 * BLOCK + 517  # a short last block
    x = torch.randn(numel) * torch.logspace(-8, 0, numel)
    x = x if signed else x.abs()
    x[BLOCK : 2 * BLOCK] = 0  # an all-zero block
    table = quant8.dynamic_map(signed)
    x[:256] = table * 3.0  # values exactly on the map
    between = (table[1:] + table[:-1]) / 2  # and halfway between two: the lower one
    x[2 * BLOCK : 2 * BLOCK + 255] = between * 2.0
    x[2 * BLOCK + 255] = 2.0
    raw = aligned_bytes(quant8.payload(numel, quant8.INT8))
    quant8.quantize(x, signed, raw)
    codes, scales = quant8.split(raw, numel)
    want_codes, want_scales = reference_quantize(x, signed)
    assert torch.equal(codes.long(), want_codes) and torch.equal(scales, want_scales)
    out = torch.empty(numel)
    quant8.dequantize(raw, numel, signed, out)
    assert torch.equal(out, reference_dequantize(want_codes, want_scales, signed))
    assert quant8.payload(numel, quant8.INT8) == 4 * math.ceil(numel / 4) + 4 * 4  # codes, then 4 absmax


def test_every_gather_path_this_cpu_runs_writes_the_same_bytes() -> None:
    """The kernel's table gathers take the widest instruction set the CPU runs (update/quant8.cpp); each narrower
    one, capped by LIGHTNING_SMARTINF_QUANT8_ISA, passes the reference checks here too, so machines agree."""
    native = quant8.kernel().isa()
    checks = "nearest_value_per_block and kernel or fused_host_update_equals or device_kernels_quantize_as_the_host"
    for isa in quant8.ISAS[quant8.ISAS.index(native) + 1 :]:
        env = {**os.environ, quant8.ISA_VARIABLE: isa}
        picked = subprocess.run([sys.executable, "-c", "from lightning_smartinf.update import quant8; "
                                 "print(quant8.kernel().isa())"], env=env, capture_output=True, text=True)  # fmt: skip
        assert picked.stdout.strip() == isa, picked.stderr[-2000:]
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", checks],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0 and " passed" in done.stdout, (isa, done.stdout[-3000:])


def test_an_unknown_instruction_set_cap_is_refused_naming_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(quant8.ISA_VARIABLE, "sse9")
    with pytest.raises(ConfigError, match="LIGHTNING_SMARTINF_QUANT8_ISA='sse9' is not one of avx512, avx2, baseline"):
        quant8.kernel.__wrapped__()


class Gradients:
    """The gradients of one step, by subgroup."""

    def __init__(self) -> None:
        self.now: dict[int, torch.Tensor] = {}

    def fetch(self, sg: Subgroup) -> Future[torch.Tensor]:
        done: Future[torch.Tensor] = Future()
        done.set_result(self.now[sg.index].clone())
        return done

    def release(self, sg: Subgroup) -> None:
        pass


@pytest.mark.parametrize("where", ["disk", "ram"])
def test_the_host_update_with_8bit_state_equals_the_reference_over_20_steps(where: str, tmp_path: Path) -> None:
    torch.manual_seed(1)
    subgroups = [Subgroup(0, 1, 0, 0, 2 * BLOCK + 904, quant8.INT8), Subgroup(1, 1, 0, 3 * BLOCK, BLOCK, quant8.INT8)]
    rule = OptimizerRule("adamw", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0)))
    backend = make_backend("threads", tmp_path, threads=2, intra_op_parallelism=1, block_size=1 << 20, queue_depth=8)
    disk = FileStore(tmp_path, backend, TrafficCounters(), "host", verify=True)
    in_ram = frozenset(sg.key for sg in subgroups) if where == "ram" else frozenset()
    store = TieredStore(disk, HostStore(), in_ram)  # in RAM: updated in place
    updater = HostUpdater(rule, store, max(sg.numel for sg in subgroups), 1, None, quant8.INT8)
    start = {sg.index: torch.randn(sg.numel) for sg in subgroups}
    updater.initialize(subgroups, lambda sg: start[sg.index])
    hyper = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}]
    history: dict[int, list[torch.Tensor]] = {sg.index: [] for sg in subgroups}
    grads = Gradients()
    masters = {}
    for step in range(1, 21):
        grads.now = {sg.index: torch.randn(sg.numel) * 10.0 ** -(step % 5) for sg in subgroups}
        for index, g in grads.now.items():
            history[index].append(g)
        for sg, master in updater.step(subgroups, grads, StepContext(step, hyper)):  # type: ignore[arg-type]
            masters[sg.index] = master.clone()
    for sg in subgroups:
        want = reference_adamw(start[sg.index], history[sg.index], 1e-3, (0.9, 0.999), 1e-8, 0.1)
        assert float((masters[sg.index] - want).abs().max()) <= 1e-6
    on_disk = quant8.payload(subgroups[0].numel, quant8.INT8)
    if where == "disk":  # the state files are the quantized bytes, about a quarter of fp32's
        assert (tmp_path / "exp_avg" / "sg000000").stat().st_size == -(-on_disk // 4096) * 4096
    raw = aligned_bytes(subgroups[0].numel * 4)
    store.read(MASTER, "sg000000", raw, subgroups[0].numel * 4).result()
    assert torch.equal(typed_view(raw, torch.float32, subgroups[0].numel), masters[0])
    updater.close()


def test_a_misspelled_precision_is_refused_naming_the_key_and_the_choices() -> None:
    from lightning_smartinf.config import OffloadConfig

    with pytest.raises(ConfigError, match=r"offload.state_precision='int8' is not one of fp32, 8bit"):
        OffloadConfig(state_precision="int8")


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_the_device_kernels_quantize_as_the_host(signed: bool) -> None:
    """fpga_kernels/quant8.cl on an OpenCL device against the host's codes, absmax values and widened values."""
    cl = pytest.importorskip("pyopencl")
    from lightning_smartinf.update.device_state import DeviceQuantizer
    from lightning_smartinf.update.opencl import DeviceSpec, open_device

    device, context, _ = open_device(DeviceSpec(), torch.float32, torch.float32)
    quantizer = DeviceQuantizer(cl, context, device)
    queue = cl.CommandQueue(context)
    torch.manual_seed(2)
    numel = 2 * BLOCK + 999
    x = torch.randn(numel) * torch.logspace(-9, 1, numel)
    x = x if signed else x.abs()
    kind = "exp_avg" if signed else "exp_avg_sq"
    host = aligned_bytes(quant8.payload(numel, quant8.INT8))
    quant8.quantize(x, signed, host)
    flags = cl.mem_flags
    wide = cl.Buffer(context, flags.READ_WRITE | flags.COPY_HOST_PTR, hostbuf=x.numpy())
    raw = cl.Buffer(context, flags.READ_WRITE, host.numel())
    quantizer.narrow(queue, wide, raw, kind, numel).wait()
    got = torch.empty(host.numel(), dtype=torch.uint8)
    cl.enqueue_copy(queue, got.numpy(), raw)
    size = quant8.payload(numel, quant8.INT8)
    differ = (got[:size] != host[:size]).nonzero().flatten()
    assert not len(differ), (device.name, differ[:8].tolist(), got[differ[:8]].tolist(), host[differ[:8]].tolist())
    quantizer.widen(queue, raw, wide, kind, numel, None)
    back = torch.empty(numel)
    cl.enqueue_copy(queue, back.numpy(), wide)
    queue.finish()
    expected = torch.empty(numel)
    quant8.dequantize(host, numel, signed, expected)
    assert torch.equal(back, expected)


RULES = {
    "adamw": (OptimizerRule("adamw", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0))),
              {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}),
    "adam": (OptimizerRule("adam", (StateSpec("exp_avg", 0.0), StateSpec("exp_avg_sq", 0.0))),
             {"lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.01}),
    "sgd": (OptimizerRule("sgd", (StateSpec("momentum_buffer", 0.0),)),
            {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01, "nesterov": False}),
    "adagrad": (OptimizerRule("adagrad", (StateSpec("sum", 0.1),)),
                {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "eps": 1e-10, "initial_accumulator_value": 0.1}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(RULES))
def test_the_fused_host_update_equals_widening_stepping_and_quantizing_apart(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one-pass kernel (the device kernels' arithmetic) against the three passes with torch's optimizer over 6
    steps, for every optimizer with state: the same weights to float rounding."""
    rule, hyper = RULES[name]
    subgroups = [Subgroup(0, 1, 0, 0, BLOCK + 77, quant8.INT8)]
    torch.manual_seed(3)
    start = torch.randn(subgroups[0].numel)
    steps = [torch.randn(subgroups[0].numel) * 10.0 ** -(i % 3) for i in range(6)]
    masters = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(quant8, "fused_step", lambda *args: False)
        store = TieredStore(FileStore(tmp_path / str(fused), make_backend("threads", tmp_path, threads=1,
                            intra_op_parallelism=1, block_size=1 << 20, queue_depth=4), TrafficCounters(), "host",
                            verify=True), HostStore(), frozenset())  # fmt: skip
        updater = HostUpdater(rule, store, subgroups[0].numel, 1, None, quant8.INT8)
        updater.initialize(subgroups, lambda sg: start)
        grads = Gradients()
        for step, grad in enumerate(steps, 1):
            grads.now = {0: grad}
            for _, master in updater.step(subgroups, grads, StepContext(step, [hyper])):  # type: ignore[arg-type]
                last = master.clone()
        masters.append(last)
        updater.close()
    assert float((masters[0] - masters[1]).abs().max()) <= 1e-6 * float(masters[1].abs().max())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_smart_update_with_8bit_state_equals_the_host_update(smart, optimizer: str) -> None:  # noqa: ANN001
    """The same run with 8-bit state on 2 near-storage devices and on the host: the state files hold the quantized
    bytes on the devices' directories, and the weights are the same bit for bit (the host's fused update does the
    device kernels' arithmetic)."""
    from helpers import fit, make_module

    settings = {"precision": "32-true", "gradient_clip_val": 0.5}
    every = {"state_precision": "8bit", "min_8bit_size": 0, "fp32_embedding_state": False}  # every state 8-bit
    host = make_module(optimizer, lr=1e-3)
    fit(host, smart(nvme_path=smart.root / "host", **every), **settings)
    on_devices = smart(nvme_path=smart.root / "dev", **every, update={"backend": "smart", "devices": 2})
    device = fit(make_module(optimizer, lr=1e-3), on_devices, **settings)
    assert "8-bit state" in device.strategy.engine.updater.name
    weights = device.strategy.consolidated_state_dict()
    differ = [name for name, value in host.named_parameters() if not torch.equal(weights[name], value.detach())]
    assert not differ, differ
    kind = "exp_avg" if optimizer == "adamw" else "momentum_buffer"
    state = next((smart.root / "dev").rglob(f"{kind}/sg000000"))
    numel = next(sg.numel for sg in device.strategy.engine.layout.subgroups if sg.key == "sg000000")
    assert state.stat().st_size == -(-quant8.payload(numel, quant8.INT8) // 4096) * 4096


def test_small_tensors_and_embeddings_keep_fp32_state_on_the_host_and_the_devices(smart) -> None:  # noqa: ANN001
    """The defaults (``offload.min_8bit_size=4096``, ``offload.fp32_embedding_state=true``): the state files of the
    subgroups that keep fp32 state are fp32, the others quantized, on the host and on 2 near-storage devices; the
    two runs agree to the fp32 state's rounding (the host steps it with torch, the devices with their kernels)."""
    from helpers import fit, make_module, relative_error

    settings = {"precision": "32-true", "gradient_clip_val": 0.5}
    host = make_module("adamw", lr=1e-3)
    fit(host, smart(nvme_path=smart.root / "host", state_precision="8bit"), **settings)
    device = fit(make_module("adamw", lr=1e-3), smart(nvme_path=smart.root / "dev", state_precision="8bit",
                 update={"backend": "smart", "devices": 2}), **settings)  # fmt: skip
    layout = device.strategy.engine.layout
    assert {sg.precision for sg in layout.subgroups} == {quant8.FP32, quant8.INT8}
    assert "gpt.wte.weight" in (layout.fp32_state or [])
    for root in (smart.root / "host", smart.root / "dev"):
        for sg in layout.subgroups:
            state = next(root.rglob(f"exp_avg_sq/{sg.key}"))
            assert state.stat().st_size == -(-quant8.payload(sg.numel, sg.precision) // 4096) * 4096, (root, sg)
    assert relative_error(device.strategy.consolidated_state_dict(), host) < 1e-5
