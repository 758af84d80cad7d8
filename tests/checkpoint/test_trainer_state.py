"""A checkpoint from elsewhere cannot run code: the trainer state is plain data, read without unpickling objects."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import io
import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from helpers import fit, make_module, token_loader
from lightning.fabric.utilities.data import AttributeDict
from omegaconf import OmegaConf

from lightning_smartinf.checkpoint.manifest import MANIFEST, TRAINER_STATE
from lightning_smartinf.checkpoint.trainer_state import UnsafeCheckpointError, dumps, load, plain
from lightning_smartinf.cli.export import main as export_main
from lightning_smartinf.models.gpt import GPTConfig


class _Payload:
    """What an attacker pickles: unpickling it calls ``Path.touch`` on the marker (it could call ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return Path.touch, (self.marker,)


def _reseal(checkpoint: Path) -> None:
    """Recompute the manifest's sums, as whoever crafts a checkpoint would: the manifest proves integrity only."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest.pop("manifest_sha256")
    data = (checkpoint / TRAINER_STATE).read_bytes()
    manifest["files"][TRAINER_STATE] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest["manifest_sha256"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=1))


@pytest.fixture
def crafted(smart, tmp_path: Path) -> tuple[Path, Path]:
    """A real checkpoint whose trainer state carries a payload in its hyper-parameters, manifest resealed."""
    strategy = smart()
    trainer = fit(make_module(), strategy, max_steps=2)
    checkpoint = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(checkpoint)
    strategy.close()
    marker = tmp_path / "payload-ran"
    state = torch.load(checkpoint / TRAINER_STATE, weights_only=True)
    state["hyper_parameters"]["evil"] = _Payload(marker)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    (checkpoint / TRAINER_STATE).write_bytes(buffer.getvalue())
    _reseal(checkpoint)
    return checkpoint, marker


def test_export_refuses_a_pickle_payload_without_running_it(crafted, tmp_path: Path, capsys) -> None:
    checkpoint, marker = crafted
    with pytest.raises(SystemExit) as done:
        export_main([str(checkpoint), str(tmp_path / "out.safetensors")])
    assert done.value.code == 1
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "smartinf-export: error:" in message and "refused" in message, message
    assert not marker.exists(), "the payload ran"
    assert not (tmp_path / "out.safetensors").exists()


def test_resume_refuses_a_pickle_payload_without_running_it(crafted, smart) -> None:
    checkpoint, marker = crafted
    with pytest.raises(UnsafeCheckpointError, match="refused"):
        fit(make_module(), smart(), max_steps=4, ckpt_path=str(checkpoint))
    assert not marker.exists(), "the payload ran"


def test_a_checkpoint_of_the_previous_format_still_loads(tmp_path: Path) -> None:
    """Before, the trainer state was pickled as Lightning built it: the GPT's config was a GPTConfig object."""
    path = tmp_path / TRAINER_STATE
    torch.save({"global_step": 3, "hyper_parameters": {"model": GPTConfig(), "betas": (0.9, 0.95)}}, path)
    assert load(path)["hyper_parameters"]["model"] == GPTConfig()


class _Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class _Shape:
    width: int
    where: Path


def test_plain_keeps_the_data_and_drops_the_objects(tmp_path: Path) -> None:
    state = {
        "hyper_parameters": AttributeDict(model=GPTConfig(), shape=_Shape(8, Path("/x")), color=_Color.RED,
                                          conf=OmegaConf.create({"a": [1, 2]}), tags={"b", "a"}),
        "loops": OrderedDict(step=torch.tensor(3)), "size": torch.Size([2, 3]), "dtype": torch.bfloat16,
    }  # fmt: skip
    path = tmp_path / TRAINER_STATE
    path.write_bytes(dumps(state))
    loaded = load(path)
    hyper = loaded["hyper_parameters"]
    assert type(hyper) is dict and hyper["model"] == dataclasses.asdict(GPTConfig())
    assert hyper["shape"] == {"width": 8, "where": "/x"} and hyper["color"] == "red"
    assert hyper["conf"] == {"a": [1, 2]} and hyper["tags"] == ["a", "b"]
    assert loaded["loops"]["step"] == 3 and loaded["size"] == torch.Size([2, 3]) and loaded["dtype"] is torch.bfloat16
    assert plain(object(), "x").startswith("<object object")


def test_a_resumed_checkpoint_rebuilds_the_gpt_config(smart, tmp_path: Path) -> None:
    """The GPT module takes its config as the dict a plain-data checkpoint holds."""
    strategy = smart()
    trainer = fit(make_module(), strategy, max_steps=2)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    strategy.close()
    hyper = load(tmp_path / "c.ckpt" / TRAINER_STATE)["hyper_parameters"]
    module = type(make_module())(**hyper)
    assert module.cfg == make_module().cfg
    fit(module, smart(), max_steps=3, ckpt_path=str(tmp_path / "c.ckpt"), loader=token_loader())


def test_an_earlier_versions_pickled_gpt_config_loads_and_only_there(tmp_path: Path) -> None:
    """Trainer states of earlier versions pickled the GPT's config: ``load`` rebuilds it, and importing the GPT does
    not make it loadable anywhere else in the process."""
    from lightning_smartinf.models.gpt import GPTConfig

    config = GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=256, block_size=4)
    torch.save({"hyper_parameters": {"cfg": config}}, tmp_path / "old.pt")
    assert load(tmp_path / "old.pt")["hyper_parameters"]["cfg"] == config
    assert GPTConfig not in torch.serialization.get_safe_globals()
