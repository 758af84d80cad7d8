"""The performance model behind smartinf-plan: the papers' mechanisms show up in its predictions."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_smartinf.bench.model import Hardware, predict
from lightning_smartinf.cli.bench import recipe_model
from lightning_smartinf.cli.plan import hardware_preset, job_of
from lightning_smartinf.update import quant8


def job(micro_batches: int = 8):  # noqa: ANN201
    return job_of(recipe_model("gpt_1_3b", 1024), 1024, 1, micro_batches)


def test_zero_infinity_saturates_at_the_host_link_while_smart_update_keeps_scaling() -> None:
    hw = hardware_preset("smart_infinity_a100")
    base = [predict("a", job(1), Hardware(**{**hw.__dict__, "ssds": k, "devices": k})).seconds for k in (6, 8, 10)]
    smart = [predict("d", job(1), Hardware(**{**hw.__dict__, "ssds": k, "devices": k}), vertical=False).seconds
             for k in (6, 8, 10)]  # fmt: skip
    assert base[0] == pytest.approx(base[2])  # 6 SSDs already fill the 12 GB/s link
    assert smart[0] > smart[1] > smart[2]


def test_vertical_reads_parameters_once_per_iteration() -> None:
    hw = hardware_preset("greedysnake_a100")
    horizontal = [predict("b", job(m), hw).parts["params_io"] for m in (1, 4)]
    vertical = [predict("c", job(m), hw).parts["params_io"] for m in (1, 4)]
    assert horizontal[1] == pytest.approx(4 * horizontal[0]) and vertical[0] == pytest.approx(vertical[1])
    assert predict("c", job(8), hw).seconds < predict("a", job(8), hw).seconds


def test_8bit_state_takes_about_6_bytes_a_parameter_off_each_way_of_the_step() -> None:
    hw = hardware_preset("greedysnake_a100")
    fp32, small = job(), dataclasses.replace(job(), state_bytes=4 + 2 * quant8.bytes_per_element(quant8.INT8))
    for system in ("b", "c"):
        saved = predict(system, fp32, hw).disk_bytes - predict(system, small, hw).disk_bytes
        assert saved == pytest.approx(2 * 5.996 * fp32.params, rel=1e-3)
    assert predict("a", small, hw).disk_bytes == predict("a", fp32, hw).disk_bytes  # DeepSpeed keeps fp32


def test_unknown_hardware_key_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown hardware keys \['ssd_count'\]"):
        Hardware.from_dict({"ssd_count": 4})


def test_compare_reports_the_error_against_a_bench_result(tmp_path) -> None:  # noqa: ANN001
    """smartinf-plan --compare reads smartinf-bench's JSON and gives predicted against measured per system."""
    import json

    from lightning_smartinf.cli.plan import compare

    hw = Hardware(tflops=2.0, ssd_read=1.0, ssd_write=1.0, host_update=2.0, compute_io_overlap=False, ssd_mixed=1.0)
    j = job(4)
    exact = predict("c", j, hw).seconds
    bench = {"results": {"c": {"params": j.params, "seconds_per_step": exact},
                         "a": {"params": j.params, "seconds_per_step": 2 * predict("a", j, hw).seconds}}}  # fmt: skip
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(bench))
    table = compare(path, j, hw)
    assert "| (c) + vertical + overlap |" in table and "| +0% |" in table and "| -50% |" in table
