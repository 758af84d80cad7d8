"""The timeline: a traced fit writes a valid Chrome trace whose phases add up to the iteration's wall time."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import fit, make_module, token_loader

from lightning_smartinf import trace
from lightning_smartinf.lightning.timeline import Trace


def test_exposed_time_is_split_by_the_innermost_open_span() -> None:
    tracer = trace.Tracer()
    ms = 1_000_000
    tracer.record("forward 1", "compute", 0, 10 * ms)
    tracer.record("fetch 1", "wait", 2 * ms, 5 * ms)  # inside the forward: 3 ms waiting
    tracer.record("optimizer step", "step", 12 * ms, 20 * ms)
    phases = tracer.exposed(0, 25 * ms)
    assert phases == {"compute": 7e-3, "wait": 3e-3, "other": 7e-3, "step": 8e-3}


def test_a_traced_fit_records_blocks_io_and_updates(smart, tmp_path: Path) -> None:
    timeline = Trace(tmp_path / "t.json", start=1, iterations=2)
    fit(make_module(), smart(), max_steps=4, loader=token_loader(samples=32), callbacks=[timeline])
    assert trace.active() is None  # recording stopped after its iterations
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["name"].split(" ")[0] for e in events if e["ph"] == "X"}
    assert {"forward", "backward", "fetch", "grads", "update", "read", "write", "iteration"} <= names
    # at budget 0 a block's backward recomputes it, or reads its graph back from storage: the planner's choice
    assert "recompute" in names or any(e["name"] == "read graphs" for e in events)
    assert {e["cat"] for e in events if e["ph"] == "X" and e["name"].startswith("read")} == {"io"}
    summary = timeline.summary
    assert summary["iterations"] == 2
    assert abs(sum(summary["phases"].values()) - summary["seconds_per_iteration"]) < 1e-6
    assert summary["io"]["read master"]["bytes"] > 0
    assert Path(summary["plot"]).stat().st_size > 10_000  # the picture of the timeline
    # the CPU work of I/O, on every thread: each byte written or read back is checksummed once (offload.verify_io)
    checksum = summary["io_cpu"]["checksum"]
    written = sum(row["bytes"] for kind, row in summary["io"].items() if kind.startswith("write"))
    assert written <= checksum["bytes"] and checksum["seconds"] > 0
    assert 0 <= checksum["training_thread_s"] <= checksum["seconds"]
