"""SmartUpdate against the host update and plain torch; its traffic; its errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import aio_is_pinned, fit, make_module, relative_error, token_loader

from lightning_smartinf.cli.traffic import Scenario, iteration_traffic
from lightning_smartinf.models.gpt import GPTConfig

CLIP = {"precision": "32-true", "gradient_clip_val": 0.5}


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "sgd", "adagrad"])
def test_smart_equals_host_and_torch(smart, optimizer: str) -> None:
    reference = make_module(optimizer, lr=1e-3)
    fit(reference, **CLIP)
    host = fit(make_module(optimizer, lr=1e-3), smart(nvme_path=smart.root / "host"), **CLIP)
    host_state = host.strategy.consolidated_state_dict()
    for devices in (1, 3):
        trainer = fit(make_module(optimizer, lr=1e-3),
                      smart(nvme_path=smart.root / f"smart{devices}", update={"backend": "smart", "devices": devices}),
                      **CLIP)  # fmt: skip
        state = trainer.strategy.consolidated_state_dict()
        assert len(trainer.strategy.engine.updater.devices) == devices
        assert relative_error(state, reference) < 1e-6
        assert _close(state, host_state)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    diff = torch.cat([(a[k] - b[k]).reshape(-1) for k in a]).norm()
    return bool(diff / torch.cat([b[k].reshape(-1) for k in b]).norm() < 1e-6)


@pytest.mark.parametrize("grads", ["cpu", "nvme"])
def test_smart_with_accumulation_and_both_gradient_homes(smart, grads: str) -> None:
    kwargs = {"precision": "32-true", "gradient_clip_val": 0.05, "accumulate_grad_batches": 4}
    reference = make_module("adamw", lr=1e-3)
    fit(reference, **kwargs)
    trainer = fit(make_module("adamw", lr=1e-3), smart(grads=grads, update={"backend": "smart", "devices": 2}),
                  **kwargs)  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-6


def _one_step_traffic(tmp_path: Path, update: dict, grads: str, dtype: torch.dtype) -> tuple[dict, int]:
    """Bytes per link/direction/kind of the second iteration (smartinf-traffic's measurement), and the params."""
    scenario = Scenario("test", update, grads, dtype)
    return iteration_traffic(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64), scenario, tmp_path)


def _host_update_bytes(delta: dict, params: int) -> float:
    """Smart-Infinity's accounting: update traffic on the host link (gradients and state/updated params)."""
    kinds = ("grad", "master", "exp_avg", "exp_avg_sq", "updated_param")
    return sum(v for k, v in delta.items() if k.startswith("host/") and k.split("/")[-1] in kinds) / params


def test_traffic_per_parameter_matches_the_paper(tmp_path: Path) -> None:
    host, n = _one_step_traffic(tmp_path / "h", {"backend": "host"}, "nvme", torch.float32)
    # gradient written in backward and read by the step (4 + 4 B), master, m, v read and written (12 + 12 B)
    assert _host_update_bytes(host, n) == 32.0
    smart_fp32, n = _one_step_traffic(tmp_path / "s", {"backend": "smart", "devices": 2}, "cpu", torch.float32)
    assert _host_update_bytes(smart_fp32, n) == 8.0
    assert smart_fp32["host/write/grad"] == smart_fp32["host/read/updated_param"] == 4 * n
    assert sum(v for k, v in smart_fp32.items() if k.startswith("device")) == 24 * n  # state, inside the devices
    smart_16, n = _one_step_traffic(tmp_path / "b", {"backend": "smart", "devices": 2, "wire": "16bit"}, "cpu",
                                    torch.bfloat16)  # fmt: skip
    assert _host_update_bytes(smart_16, n) == 4.0


def test_gradients_written_into_the_device_directories(tmp_path: Path) -> None:
    delta, n = _one_step_traffic(tmp_path, {"backend": "smart", "devices": 2}, "nvme", torch.float32)
    assert delta["host/read/updated_param"] == 4 * n
    assert delta["host/write/grad"] == 4 * n  # the gradient crossed the host link once, in backward
    assert delta["device0/read/grad"] + delta["device1/read/grad"] == 4 * n  # and was read over the devices' links
    assert "host/read/grad" not in delta
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["device0", "device1", "param"]


def test_checkpoint_resume_with_smart_update(smart, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    batch = next(iter(token_loader()))
    loader = torch.utils.data.DataLoader(batch.repeat(3, 1), batch_size=4)
    upd = {"backend": "smart", "devices": 3}
    straight = fit(make_module(), smart(nvme_path=tmp_path / "a", update=upd), max_steps=6, loader=loader)
    expected = straight.strategy.consolidated_state_dict()
    first = fit(make_module(), smart(nvme_path=tmp_path / "b", update=upd), max_steps=3, loader=loader)
    first.save_checkpoint(tmp_path / "ckpt")
    trainer = pl.Trainer(
        strategy=smart(nvme_path=tmp_path / "c", update=upd),
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(make_module(seed=1), loader, ckpt_path=tmp_path / "ckpt")
    got = trainer.strategy.consolidated_state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_no_matching_platform_lists_what_exists(smart) -> None:
    with pytest.raises(RuntimeError, match="no OpenCL platform matching 'NoSuchVendor'.*found:.*pyopencl\\[pocl\\]"):
        fit(make_module(), smart(update={"backend": "smart", "devices": [{"platform": "NoSuchVendor"}]}), max_steps=1)


def test_missing_device_index(smart) -> None:
    with pytest.raises(RuntimeError, match="index 7 does not exist.*POCL_DEVICES"):
        fit(make_module(), smart(update={"backend": "smart", "devices": [{"device": 7}]}), max_steps=1)


def test_kernel_build_failure_shows_the_log(smart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_smartinf.update.opencl as opencl

    broken = tmp_path / "kernels"
    broken.mkdir()
    (broken / "optimizers.cl").write_text("__kernel void adam(__global float* x) { x[0] = undefined_name; }")
    monkeypatch.setattr(opencl, "asset_dir", lambda name: broken)
    with pytest.raises(RuntimeError, match="failed to build(.|\\n)*undefined_name"):
        fit(make_module(), smart(update={"backend": "smart", "devices": 1}), max_steps=1)


def test_binary_for_another_device(smart, tmp_path: Path) -> None:
    binary = tmp_path / "other.xclbin"
    binary.write_bytes(b"xclbin2\x00" + bytes(64))
    with pytest.raises(RuntimeError, match="does not load"):
        fit(make_module(), smart(update={"backend": "smart", "devices": [{"binary": str(binary)}]}), max_steps=1)


def test_device_directory_without_room(smart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100) if "FULL" in str(p) else real(p))
    target = tmp_path / "FULL"
    spec = [{"device": 0, "path": str(target)}]
    message = r"update.devices\[0\].path='.*FULL' has 100 B free but the offloaded state needs"
    with pytest.raises(OSError, match=message):
        fit(make_module(), smart(update={"backend": "smart", "devices": spec}), max_steps=1)


def test_16bit_wire_needs_16bit_training(smart) -> None:
    with pytest.raises(ValueError, match="update.wire=16bit needs a 16-bit training precision"):
        fit(make_module(), smart(grads="cpu", update={"backend": "smart", "wire": "16bit"}), precision="32-true",
            max_steps=1)  # fmt: skip


def test_device_buffers_are_page_locked_and_freed_at_close(smart) -> None:
    """With the aio backend the devices' slot memory is DeepSpeed-pinned (no bounce buffer per request), and
    closing the strategy stops each device's handler and frees its slots."""
    strategy = smart(io_backend="aio", update={"backend": "smart", "devices": 2})
    trainer = fit(make_module("adamw", lr=1e-3), strategy, precision="32-true", max_steps=2)
    devices = trainer.strategy.engine.updater.devices
    assert all(aio_is_pinned(raw) for d in devices for slot in d.slots for raw in slot.host.values())
    trainer.strategy.close()
    assert all(not d.slots and not d._thread.is_alive() for d in devices)


def test_every_kernel_argument_table_matches_its_signature() -> None:
    """The host's named tables are the kernels' signatures (NamedKernel refuses to build otherwise)."""
    from lightning_smartinf.update.arguments import KERNEL_ARGUMENTS
    from lightning_smartinf.update.opencl import KERNEL_SOURCE, QUANT_SOURCE, SPARSE_SOURCE, kernel_signatures

    declared = {**kernel_signatures(KERNEL_SOURCE), **kernel_signatures(SPARSE_SOURCE),
                **kernel_signatures(QUANT_SOURCE)}  # fmt: skip
    assert declared == KERNEL_ARGUMENTS


def test_a_table_that_drifts_from_the_kernel_is_refused_at_build() -> None:
    from lightning_smartinf.errors import SetupError
    from lightning_smartinf.update.arguments import KERNEL_ARGUMENTS
    from lightning_smartinf.update.opencl import KERNEL_SOURCE, NamedKernel

    swapped = ("grad", "master", *KERNEL_ARGUMENTS["adam"][2:])
    with pytest.raises(SetupError, match="kernel adam .* takes .* but the host passes"):
        NamedKernel(object(), "adam", KERNEL_SOURCE, swapped)


def test_smart_sgd_without_momentum_equals_torch(smart) -> None:
    """SGD without momentum has no state: the kernel's unused momentum argument gets a placeholder."""

    def plain_sgd(module: torch.nn.Module) -> torch.nn.Module:
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=1e-3)  # type: ignore[method-assign]
        return module

    reference = plain_sgd(make_module("sgd"))
    fit(reference, **CLIP)
    trainer = fit(plain_sgd(make_module("sgd")), smart(update={"backend": "smart", "devices": 1}), **CLIP)
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-6
