"""State striped over several directories (``offload.nvme_path`` as a list): same training, files on every disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers import fit, make_module, token_loader
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_smartinf import SmartInfinityStrategy
from lightning_smartinf.checkpoint import latest_checkpoint
from lightning_smartinf.config import OffloadConfig
from lightning_smartinf.storage.store import stripe_of


def strategy(paths: Any) -> SmartInfinityStrategy:
    offload = {"nvme_path": paths, "subgroup_size": 4096, "io_backend": "threads", "host_memory_budget": "0"}
    return SmartInfinityStrategy(offload=offload, update={"host_adam": "torch"})


def test_striped_state_trains_bit_equal_with_files_on_every_directory(tmp_path: Path) -> None:
    single = fit(make_module(), strategy(str(tmp_path / "one")), precision="32-true", max_steps=4)
    expected = single.strategy.consolidated_state_dict()
    single.strategy.close()  # type: ignore[attr-defined]

    disks = [tmp_path / "disk0", tmp_path / "disk1", tmp_path / "disk2"]
    striped = fit(make_module(), strategy([str(d) for d in disks]), precision="32-true", max_steps=4)
    got = striped.strategy.consolidated_state_dict()
    engine = striped.strategy.engine  # type: ignore[attr-defined]
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    for sg in engine.layout.subgroups:  # every subgroup's files on its own stripe, and only there
        home = disks[stripe_of(sg.key, 3)]
        assert all((d / "master" / sg.key).is_file() == (d == home) for d in disks)
    assert {stripe_of(sg.key, 3) for sg in engine.layout.subgroups} == {0, 1, 2}
    striped.strategy.close()  # type: ignore[attr-defined]


def test_striped_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    disks = [str(tmp_path / "disk0"), str(tmp_path / "disk1")]

    def train(steps: int, resume: Path | None = None) -> dict[str, torch.Tensor]:
        run = strategy(disks)
        trainer = pl.Trainer(
            strategy=run, accelerator="cpu", devices=1, max_steps=steps, precision="32-true", logger=False,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)],
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(make_module(seed=1 if resume else 0), token_loader(samples=16), ckpt_path=resume)
        state = run.consolidated_state_dict()
        run.close()
        return state

    expected = train(6)
    resume = latest_checkpoint(tmp_path / "ckpts")
    assert resume is not None and resume.name.endswith("step=6.ckpt")
    assert sorted(p.name for p in (resume / "offload").iterdir()) == ["state0", "state1"]
    got = train(6, resume=tmp_path / "ckpts" / "epoch=0-step=4.ckpt")
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.parametrize(
    ("paths", "message"),
    [([], "give a directory"), ("", "give a directory"), (["/a", "/a"], "lists a directory twice")],
)
def test_bad_state_paths_name_the_key(paths: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        OffloadConfig(nvme_path=paths)
    assert "offload.nvme_path" in str(err.value)
