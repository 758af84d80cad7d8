"""The strategy settings of smartinf-bench's systems: each row runs what its name says."""

from __future__ import annotations

from lightning_smartinf.bench.systems import NAMES, SYSTEMS, Workload, strategy_settings
from lightning_smartinf.config import strategy_groups

WORKLOAD = Workload({"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 256}, 32, 1, 4, "bf16-mixed", "state")


def test_the_8bit_rows_differ_from_their_fp32_rows_in_the_state_precision_only() -> None:
    w = WORKLOAD
    for fp32, eight_bit in (("s", "q"), ("c", "v")):
        plain, quantized = strategy_settings(fp32, w, "state"), strategy_settings(eight_bit, w, "state")
        assert quantized["offload"].pop("state_precision") == "8bit" and "8-bit state" in NAMES[eight_bit]
        assert quantized == plain
    assert strategy_settings("v", w, "state")["schedule"]["kind"] == "vertical"


def test_every_system_but_deepspeed_is_a_valid_strategy_config() -> None:
    for system in SYSTEMS[1:]:
        settings = strategy_settings(system, WORKLOAD, "state")
        strategy_groups(*(settings.get(group) for group in ("offload", "update", "compression", "schedule")))
