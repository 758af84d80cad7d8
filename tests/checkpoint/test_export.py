"""smartinf-export: a checkpoint becomes a safetensors file that the plain GPT module loads without the strategy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import fit, make_module

from lightning_smartinf.cli.export import main as export_main
from lightning_smartinf.models.gpt import GPTModule


@pytest.fixture
def checkpoint(smart, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    strategy = smart()
    trainer = fit(make_module(), strategy, max_steps=3)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    masters = strategy.consolidated_state_dict()
    strategy.close()
    return tmp_path / "step3.ckpt", masters


def test_fp32_export_loads_into_the_plain_module_exactly(checkpoint, tmp_path: Path, capsys) -> None:
    path, masters = checkpoint
    export_main([str(path), str(tmp_path / "out"), "--dtype", "fp32"])
    assert "model.safetensors" in capsys.readouterr().out
    module = GPTModule.from_safetensors(tmp_path / "out" / "model.safetensors")
    assert module.cfg == make_module().cfg
    params = dict(module.named_parameters())
    assert params.keys() == masters.keys()
    assert all(torch.equal(params[k].detach(), masters[k]) for k in masters)
    batch = torch.randint(0, 256, (2, 9))
    assert module(batch[:, :-1]).shape == (2, 8, 256)  # a working model, no strategy involved


def test_bf16_export(checkpoint, tmp_path: Path) -> None:
    path, masters = checkpoint
    export_main([str(path), str(tmp_path / "m.safetensors")])
    module = GPTModule.from_safetensors(tmp_path / "m.safetensors")
    assert all(torch.equal(p.detach(), masters[k].bfloat16().float()) for k, p in module.named_parameters())


def test_export_refuses_a_damaged_checkpoint_naming_the_file(checkpoint, tmp_path: Path, capsys) -> None:
    path, _ = checkpoint
    victim = next((path / "offload").rglob("sg000001"))
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(SystemExit) as done:
        export_main([str(path), str(tmp_path / "m.safetensors")])
    assert done.value.code == 1
    message = capsys.readouterr().err
    assert message.startswith("smartinf-export: error: checkpoint ")
    assert f"{victim.relative_to(path)}: truncated (100 bytes" in message
    assert not (tmp_path / "m.safetensors").exists()
