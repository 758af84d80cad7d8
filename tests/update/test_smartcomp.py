"""SmartComp end to end: compressed gradients through SmartUpdate, host-link bytes, and config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fit, make_module, relative_error

from lightning_smartinf.strategy import SmartInfinityStrategy

SMART = {"backend": "smart", "devices": 2}


def strategy(path: Path, compression: dict[str, object], **offload: object) -> SmartInfinityStrategy:
    settings = {"nvme_path": str(path), "subgroup_size": 4096, "io_backend": "threads", "grads": "cpu", **offload}
    return SmartInfinityStrategy(offload=settings, update=SMART, compression=compression)


def test_keep_everything_is_dense_training_up_to_16bit_values(tmp_path: Path) -> None:
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true")
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "keep": 1.0}),
                  precision="32-true")  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-4  # bf16 rounding of values


def test_warmup_steps_are_dense_and_exact(tmp_path: Path) -> None:
    reference = make_module("adamw", lr=1e-3)
    fit(reference, precision="32-true")
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "warmup_steps": 10}),
                  precision="32-true")  # fmt: skip
    assert relative_error(trainer.strategy.consolidated_state_dict(), reference) < 1e-6


def test_host_link_bytes_with_keep_one_percent(tmp_path: Path) -> None:
    """4 B/param of updated fp32 params back, plus keep x (4 B index + 2 B value) out: 4.06 B at keep=0.01."""
    trainer = fit(make_module("adamw", lr=1e-3), strategy(tmp_path, {"kind": "topk", "keep": 0.01,
                  "block": 4096, "error_feedback": True}), precision="32-true", max_steps=5)  # fmt: skip
    engine = trainer.strategy.engine
    host = engine.counters
    steps, params = engine.step_count, engine.layout.num_params
    update_bytes = sum(host.total(link="host", kind=k) for k in ("grad_index", "grad_value", "updated_param"))
    per_param = update_bytes / params / steps
    assert per_param <= 4.1
    assert host.total(link="host", kind="grad") == 0  # no dense gradient crossed the host link
    assert per_param == pytest.approx(4 + 6 * sum(_nnz(engine, sg.numel) for sg in engine.layout.subgroups) / params)


def _nnz(engine: object, numel: int) -> int:
    from lightning_smartinf.compress.topk import max_nnz

    return max_nnz(numel, engine.compression)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("update", "offload", "message"), [
    ({"backend": "host"}, {"grads": "cpu"}, "needs update.backend=smart"),
    (SMART, {"grads": "nvme"}, "set offload.grads=cpu"),
    ({**SMART, "wire": "16bit"}, {"grads": "cpu"}, "use update.wire=fp32"),
])  # fmt: skip
def test_unsupported_combinations_name_the_keys(update: dict, offload: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SmartInfinityStrategy(offload=offload, update=update, compression={"kind": "topk"})
