"""``smartinf-plan``: memory, disk and predicted iteration time of systems (a)-(e) for a recipe on any hardware.

    smartinf-plan --recipe gpt_350m --measure                        # this machine, measured by short probes
    smartinf-plan --recipe gpt_65b --hardware greedysnake_a100       # a described machine (recipes/hardware/*.yaml)
    smartinf-plan --recipe gpt_2_7b --hardware smart_infinity_a100 --set devices=4 ssds=4
    smartinf-plan --measure --compare smartinf_bench/benchmarks.json # predicted against smartinf-bench's measures
    smartinf-plan --hardware smart_infinity_a100 --sweep-devices 10 --plot devices.png

The time model: ``lightning_smartinf/schedule/timing.py`` (the one ``schedule=auto`` plans with; system (c)'s plan is
printed as ``schedule=auto`` would choose it); the systems' bytes: ``lightning_smartinf/bench/model.py``; validation
and the papers: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
from pathlib import Path
from typing import Any

import psutil
import torch
from omegaconf import OmegaConf

from lightning_smartinf import extras
from lightning_smartinf.bench.model import (
    GB,
    MODELED,
    Hardware,
    Job,
    describe,
    machine_of,
    memory_needs,
    predict,
    workload_of,
)
from lightning_smartinf.bench.systems import NAMES, Workload
from lightning_smartinf.cli.bench import recipe_model, run_one
from lightning_smartinf.config import OffloadConfig
from lightning_smartinf.engine.layout import eight_bit_params
from lightning_smartinf.models.gpt import GPT, GPTConfig
from lightning_smartinf.resources import asset_dir
from lightning_smartinf.schedule import timing
from lightning_smartinf.schedule.planner import Plan, plan, probe_machine
from lightning_smartinf.update import quant8


def job_of(model: dict[str, Any], seq: int, micro_batch: int, micro_batches: int) -> Job:
    d, layers, vocab = model["n_embd"], model["n_layer"], model["vocab_size"]
    block = 12 * d * d + 13 * d  # attention (4 d^2) + MLP (8 d^2) + biases and norms
    resident = vocab * d + model.get("block_size", seq) * d + 2 * d
    tokens = seq * micro_batch * micro_batches
    return Job(layers * block + resident, layers * block, tokens, micro_batches, 2 * d * (layers + 1))


def gpt_on_meta(model: dict[str, Any]) -> torch.nn.Module:
    """A GPT recipe's network built on meta (no weights): which of its parameters keep fp32 state."""
    with torch.device("meta"):
        return GPT(GPTConfig(**{f.name: model[f.name] for f in dataclasses.fields(GPTConfig) if f.name in model}))


def fp32_share(built: torch.nn.Module, min_size: int, embeddings_fp32: bool) -> float:
    """The share of the trainable parameters that keep fp32 state beside 8-bit state (``engine.layout.
    eight_bit_params``: small tensors, embeddings), as the run's layout stores them."""
    trainable = sum(p.numel() for p in built.parameters() if p.requires_grad)
    quantized = eight_bit_params(built, min_size, embeddings_fp32)
    eight = sum(p.numel() for p in built.parameters() if id(p) in quantized)
    return 1 - eight / trainable if trainable else 0.0


def state_bytes(precision: str, share_fp32: float) -> float:
    """Bytes of fp32 master and optimizer state a trainable parameter keeps on storage, averaged over them: 12 in
    fp32; with 8-bit state those that keep fp32 state (``share_fp32`` of them) count 12 and the rest about 6."""
    fp32 = quant8.bytes_per_element(quant8.FP32)
    if precision == quant8.FP32:
        return 4 + 2 * fp32
    return 4 + 2 * (share_fp32 * fp32 + (1 - share_fp32) * quant8.bytes_per_element(precision))


def hf_job(model: dict[str, Any], seq: int, micro_batch: int, micro_batches: int,
           lora: dict[str, Any] | None = None) -> tuple[Job, int, torch.nn.Module]:  # fmt: skip
    """A Hugging Face architecture recipe's job, counted on the model built on meta (no weights), its layers and the
    model; with ``lora``, a bf16 base frozen under adapters (what trains, what only streams)."""
    from lightning_smartinf.ecosystem.hf import build_model, load_config, with_lora

    config = load_config(None, model["config"])
    with torch.device("meta"):
        built = build_model(config, torch.bfloat16 if lora else torch.float32)
        if lora:
            built = with_lora(built, lora, None)
    blocks = [m for m in built.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    in_blocks = {id(p) for p in blocks[0].parameters()} if blocks else set()
    count: dict[tuple[bool, bool], int] = {}
    for p in built.parameters():
        key = (p.requires_grad, id(p) in in_blocks)
        count[key] = count.get(key, 0) + p.numel()
    layers, d = config.num_hidden_layers, config.hidden_size
    job = Job(count.get((True, True), 0) + count.get((True, False), 0), count.get((True, True), 0),
              seq * micro_batch * micro_batches, micro_batches, 2 * d * (layers + 1),
              frozen=count.get((False, True), 0), frozen_resident=count.get((False, False), 0))  # fmt: skip
    return job, layers, built


def hardware_preset(name: str) -> Hardware:
    path = Path(name) if Path(name).is_file() else asset_dir("recipes") / "hardware" / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (asset_dir("recipes") / "hardware").glob("*.yaml")))
        raise SystemExit(f"--hardware={name!r} is neither a file nor one of: {known}")
    values: Any = OmegaConf.to_container(OmegaConf.load(path))
    return Hardware.from_dict({"name": path.stem, **values})


def engine_bandwidth(nvme_path: Path, flops: float) -> float:
    """Disk bytes/s the engine itself sustains: a 3-step run of system (b) on a 2-block GPT (about 60M
    parameters), its disk bytes over its time less its compute. The raw probe's large requests at full queue depth
    are a best case that training, with compute, copies and the update sharing the cores, does not reach."""
    work = Workload({"n_layer": 2, "n_head": 16, "n_embd": 1024, "vocab_size": 50304, "block_size": 128}, 128, 1,
                    2, "bf16-mixed", str(nvme_path), steps=3)  # fmt: skip
    scratch = nvme_path / "engine_probe"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        r = run_one("b", work, scratch, 0)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    compute = 8 * r["params"] * work.tokens_per_step / flops
    return (r["disk_read_per_step"] + r["disk_write_per_step"]) / max(r["seconds_per_step"] - compute, 1e-3)


def measure(nvme_path: Path, devices: int) -> Hardware:
    """This machine by short probes: matmul FLOP/s, O_DIRECT disk bandwidth (raw, and as the engine sustains it),
    CPU Adam (DeepSpeed's op where it builds) and one OpenCL device's Adam throughput; the PoCL devices share the
    disk."""
    from lightning_smartinf.cli.kernel_bench import deepspeed_adam, opencl_adam
    from lightning_smartinf.cli.kernel_bench import measure as time_calls

    def rate(run: Any, n: int) -> float:  # G params/s, median of 4 calls after a warm-up
        return n / statistics.median(time_calls({"kernel": run}, reps=4, rounds=1)["kernel"]) / 1e9

    nvme_path.mkdir(parents=True, exist_ok=True)
    m = probe_machine(torch.device("cpu"), nvme_path, torch.bfloat16)
    mixed = engine_bandwidth(nvme_path, m.flops)
    n = 1 << 22
    try:
        host_update = rate(deepspeed_adam(n), n)
    except Exception:  # noqa: BLE001 - no DeepSpeed op: torch's Adam is what the engine would use
        host_update = 0.2
    try:
        device_update = rate(opencl_adam(n, "Portable Computing Language"), n)
    except Exception:  # noqa: BLE001 - no OpenCL here: SmartUpdate cannot run, say so with a zero rate
        device_update = 0.0
    ram = psutil.virtual_memory().total / GB
    return Hardware("this machine (measured)", 1, m.flops / 1e12, ram, ram, 1, m.disk_read / GB, m.disk_write / GB,
                    host_link=50.0, host_update=host_update, devices=devices, device_internal=m.disk_read / GB,
                    device_update=device_update, shared_disk=True, compute_io_overlap=False,
                    ssd_mixed=mixed / GB)  # fmt: skip


def auto_plan(work: timing.Workload, machine: timing.Machine, micro_batches: int) -> Plan:
    """What ``schedule=auto`` decides for system (c) with ``micro_batches`` batches accumulated per step: the
    planner's own search over the one time model (``schedule/timing.py``), for a workload and machine that
    describe a recipe on hardware rather than measure a running engine."""
    return plan(work, machine, choices=[micro_batches])


def settings_for(system: str, hw: Hardware, seq: int, micro_batch: int, micro_batches: int) -> str:
    """The ``smartinf-train`` overrides that run ``system`` on the planned global batch."""
    if system == "a":
        return "(DeepSpeed: see smartinf-bench's deepspeed_config.json)"
    parts = ["offload.grads=cpu", f"data.seq_len={seq}"]
    if system in ("c", "d", "e"):  # one batch of M micro-batches per step
        parts += [f"data.batch_size={micro_batch * micro_batches}", "schedule=vertical",
                  f"schedule.micro_batches={micro_batches}", "schedule.overlap=1.0"]  # fmt: skip
    else:
        parts += ["schedule=horizontal", f"data.batch_size={micro_batch}",
                  f"trainer.accumulate_grad_batches={micro_batches}"]  # fmt: skip
    if system in ("d", "e"):
        parts += ["update=smart", f"update.devices={hw.devices}"]
    if system == "e":
        parts += ["compression=topk", "compression.keep=0.01", "compression.error_feedback=true"]
    return " ".join(parts)


def compare(bench_json: Path, job: Job, hw: Hardware) -> str:
    """Predicted against measured seconds per step, per system in a smartinf-bench result."""
    bench = json.loads(bench_json.read_text())
    lines = ["| system | measured s | predicted s | error |", "|---|---|---|---|"]
    for system, r in bench["results"].items():
        if system not in MODELED:
            continue
        got = predict(system, dataclasses.replace(job, params=r["params"]), hw).seconds
        lines.append(f"| ({system}) {NAMES[system]} | {r['seconds_per_step']:.2f} | {got:.2f} | "
                     f"{(got - r['seconds_per_step']) / r['seconds_per_step']:+.0%} |")  # fmt: skip
    return "\n".join(lines)


def sweep_devices(job: Job, hw: Hardware, most: int, plot: Path | None) -> str:
    """Smart-Infinity's Figure: SmartUpdate's speedup over ZeRO-Infinity as devices (and SSDs) are added."""
    lines = ["| devices = SSDs | (a) s | SmartUpdate s | speedup | + SmartComp speedup |", "|---|---|---|---|---|"]
    xs, ups, comps = [], [], []
    for k in range(1, most + 1):
        each = Hardware(**{**hw.__dict__, "devices": k, "ssds": k})
        base = predict("a", job, each).seconds
        smart = predict("d", job, each, vertical=False).seconds
        comp = predict("e", job, each, vertical=False).seconds
        xs.append(k)
        ups.append(base / smart)
        comps.append(base / comp)
        lines.append(f"| {k} | {base:.2f} | {smart:.2f} | {base / smart:.2f}x | {base / comp:.2f}x |")
    if plot is not None:
        plt = extras.pyplot("smartinf-plan --plot")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(xs, ups, "o-", label="SmartUpdate")
        ax.plot(xs, comps, "s-", label="SmartUpdate + SmartComp")
        ax.axhline(1.0, color="#888", lw=0.8)
        ax.set(xlabel="computational SSDs (ZeRO-Infinity: same SSDs, RAID-0)", ylabel="speedup over ZeRO-Infinity",
               title=f"predicted, {hw.name}")  # fmt: skip
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="gpt_125m")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=4)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hardware", help="a preset in recipes/hardware/ or a YAML file of Hardware fields")
    source.add_argument("--measure", action="store_true", help="probe this machine")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override hardware fields")
    parser.add_argument("--devices", type=int, default=2, help="near-storage devices with --measure")
    parser.add_argument("--nvme-path", default="smartinf_plan_probe")
    parser.add_argument("--compare", type=Path, help="a smartinf-bench benchmarks.json to compare against")
    parser.add_argument("--sweep-devices", type=int, help="predict SmartUpdate's speedup for 1..N devices")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--lora-rank", type=int, help="an HF recipe with LoRA adapters of this rank over a frozen "
                        "bf16 base (q/k/v/o projections): what trains and what only streams")  # fmt: skip
    parser.add_argument("--state-precision", choices=quant8.PRECISIONS, default=quant8.FP32,
                        help="offload.state_precision of the host update's systems (b), (c)")
    parser.add_argument("--min-8bit-size", type=int, default=OffloadConfig.min_8bit_size,
                        help="offload.min_8bit_size: smaller tensors keep fp32 state")
    parser.add_argument("--fp32-embedding-state", action=argparse.BooleanOptionalAction,
                        default=OffloadConfig.fp32_embedding_state, help="offload.fp32_embedding_state")
    args = parser.parse_args(argv)
    model = recipe_model(args.recipe, args.seq)
    if model.get("kind") == "hf":
        if args.layers:
            model["config"] = {**model["config"], "num_hidden_layers": args.layers}
        lora = None
        if args.lora_rank:
            lora = {"r": args.lora_rank, "alpha": 2 * args.lora_rank, "dropout": 0.0,
                    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # fmt: skip
        job, layers, built = hf_job(model, args.seq, args.micro_batch, args.micro_batches, lora)
    else:
        layers = model["n_layer"] = args.layers or model["n_layer"]
        job = job_of(model, args.seq, args.micro_batch, args.micro_batches)
        built = gpt_on_meta(model)
    share = fp32_share(built, args.min_8bit_size, args.fp32_embedding_state)
    job = dataclasses.replace(job, state_bytes=state_bytes(args.state_precision, share))
    if not (args.measure or args.hardware):
        parser.error("give --hardware NAME (recipes/hardware/) or --measure")
    hw = measure(Path(args.nvme_path), args.devices) if args.measure else hardware_preset(args.hardware)
    overrides = dict(item.split("=", 1) for item in args.set)
    if overrides:
        typed = {k: type(getattr(hw, k))(v) if k in hw.__dict__ else v for k, v in overrides.items()}
        hw = Hardware.from_dict({**hw.__dict__, **typed})
    frozen = (f" ({job.params / 1e6:.1f} M trainable adapters over a frozen base of "
              f"{(job.frozen + job.frozen_resident) / 1e9:.2f} B)") if job.frozen else ""  # fmt: skip
    print(f"{args.recipe}: {job.model_params / 1e9:.2f} B parameters{frozen}, {job.tokens:,.0f} tokens per iteration "
          f"in {job.micro_batches} micro-batches, on {hw.name}:")  # fmt: skip
    print("  " + ", ".join(f"{k}={v}" for k, v in hw.__dict__.items() if k != "name"))
    if args.state_precision != quant8.FP32:
        print(f"  {args.state_precision} state: {job.state_bytes:.2f} B/param of master and optimizer state in (b), "
              f"(c); {share:.1%} of the parameters keep fp32 state (--min-8bit-size, --fp32-embedding-state)")
    systems = [s for s in MODELED if hw.devices > 0 and hw.device_update > 0 or s in ("a", "b", "c")]
    predictions = [predict(s, job, hw) for s in systems]
    print(describe(predictions, job))
    auto = auto_plan(workload_of("c", job), machine_of(hw), job.micro_batches)
    print(f"\n(c) as schedule=auto plans it with trainer.accumulate_grad_batches={job.micro_batches}:\n  "
          f"{auto.describe()}")  # fmt: skip
    best = min(predictions, key=lambda x: x.seconds)
    print(f"\nrecommended: ({best.system}) {NAMES[best.system]} ({best.seconds:.2f} s/iteration, bound by "
          f"{best.bottleneck})")  # fmt: skip
    settings = settings_for(best.system, hw, args.seq, args.micro_batch, args.micro_batches)
    if args.state_precision != quant8.FP32 and best.system in ("b", "c"):
        settings += f" offload.state_precision={args.state_precision}"
        if args.min_8bit_size != OffloadConfig.min_8bit_size:
            settings += f" offload.min_8bit_size={args.min_8bit_size}"
        if args.fp32_embedding_state != OffloadConfig.fp32_embedding_state:
            settings += f" offload.fp32_embedding_state={str(args.fp32_embedding_state).lower()}"
    adapters = f" model.path=DIR peft=lora peft.r={args.lora_rank}" if args.lora_rank else ""
    print(f"  settings: smartinf-train recipe={args.recipe}{adapters} {settings}")
    print("memory and disk needed per tier:")
    for tier, nbytes in memory_needs(job, hw, best.system, layers).items():
        print(f"  {tier}: {nbytes / GB:.1f} GB")
    if args.compare:
        print("\n" + compare(args.compare, job, hw))
    if args.sweep_devices:
        print("\n" + sweep_devices(job, hw, args.sweep_devices, args.plot))


if __name__ == "__main__":
    main()
