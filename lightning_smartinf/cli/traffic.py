"""``smartinf-traffic``: bytes per parameter per iteration on every link, for each update backend, from the counters.

Runs two iterations (backward + step) of a GPT recipe's model under each configuration and prints the second
one's traffic (the first step starts optimizer state in memory), split by link and kind. The columns reproduce
Smart-Infinity's Table I: the host update moves 32 B/param over the host link; SmartUpdate 8 B (fp32 on the wire)
or 4 B (16-bit), with the optimizer state moving inside the devices instead; SmartComp at keep=0.01 about 4.06 B
(4.08 B with catch-up).

    smartinf-traffic --layers 4 --width 256 --devices 2
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_smartinf.config import CompressionConfig, OffloadConfig, UpdateConfig
from lightning_smartinf.engine.engine import OffloadEngine
from lightning_smartinf.models.gpt import GPT, GPTConfig

UPDATE_KINDS = (
    "grad",
    "grad_index",
    "grad_value",
    "grad_square",
    "master",
    "exp_avg",
    "exp_avg_sq",
    "last_step",
    "updated_param",
)


@dataclass
class Scenario:
    name: str
    update: dict[str, object]
    grads: str
    dtype: torch.dtype
    compression: CompressionConfig | None = None


def scenarios(devices: int) -> list[Scenario]:
    smart = {"backend": "smart", "devices": devices}
    return [
        Scenario("host update (ZeRO-Infinity), fp32 grads on NVMe", {"backend": "host"}, "nvme", torch.float32),
        Scenario("SmartUpdate, fp32 wire, grads sent from host RAM", smart, "cpu", torch.float32),
        Scenario("SmartUpdate, fp32 grads written into the devices", smart, "nvme", torch.float32),
        Scenario("SmartUpdate, 16-bit wire (bf16)", {**smart, "wire": "16bit"}, "cpu", torch.bfloat16),
        Scenario("SmartUpdate + SmartComp top-k keep=0.01 (fp32 params back)", smart, "cpu", torch.float32,
                 CompressionConfig(kind="topk", keep=0.01)),
        Scenario("  + error feedback and catch-up (16-bit sums of squares too)", smart, "cpu", torch.float32,
                 CompressionConfig(kind="topk", keep=0.01, error_feedback=True, catch_up=True)),
    ]  # fmt: skip


def iteration_traffic(model_cfg: GPTConfig, scenario: Scenario, root: Path) -> tuple[dict[str, int], int]:
    torch.manual_seed(0)
    model = GPT(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    offload = OffloadConfig(nvme_path=str(root), grads=scenario.grads, subgroup_size=1 << 20, host_memory_budget="0")
    engine = OffloadEngine(model, optimizer, offload, UpdateConfig(**scenario.update),  # type: ignore[arg-type]
                           torch.device("cpu"), scenario.dtype, compression=scenario.compression)  # fmt: skip
    tokens = torch.randint(0, 256, (2, 65))
    before: dict[str, int] = {}
    for _ in range(2):
        before = _flat(engine.counters.table())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=scenario.dtype != torch.float32):
            logits = model(tokens[:, :-1])
        engine.backward(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)))
        engine.step()
    after = _flat(engine.counters.table())
    engine.close()
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}, engine.layout.num_params


def _flat(table: dict[str, dict[str, int]]) -> dict[str, int]:
    return {f"{link_dir}/{kind}": n for link_dir, kinds in table.items() for kind, n in kinds.items()}


def format_row(name: str, delta: dict[str, int], params: int) -> str:
    def per_param(pred: Callable[[str], bool]) -> float:
        return sum(v for k, v in delta.items() if pred(k)) / params

    host_update = per_param(lambda k: k.startswith("host/") and k.split("/")[-1] in UPDATE_KINDS)
    host_read = per_param(lambda k: k.startswith("host/read/") and k.split("/")[-1] in UPDATE_KINDS)
    host_write = per_param(lambda k: k.startswith("host/write/") and k.split("/")[-1] in UPDATE_KINDS)
    devices = per_param(lambda k: k.startswith("device"))
    params16 = per_param(lambda k: k.startswith("host/") and k.endswith("/param"))
    return (f"| {name} | {host_read:.2f} | {host_write:.2f} | **{host_update:.2f}** | {devices:.2f} | "
            f"{params16:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    cfg = GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, block_size=64)
    print(
        f"GPT {args.layers} layers x width {args.width}: {cfg.num_params():,} parameters, AdamW, bytes per parameter"
        " in one iteration (backward + step)\n"
    )
    print(
        "| configuration | host link read | host link write | host link total (Table I) | inside the devices | "
        "16-bit params on the host link |"
    )
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        for i, scenario in enumerate(scenarios(args.devices)):
            delta, params = iteration_traffic(cfg, scenario, Path(tmp) / str(i))
            print(format_row(scenario.name, delta, params))


if __name__ == "__main__":
    main()
