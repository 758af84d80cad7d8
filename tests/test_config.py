"""Bad input fails early and names the key and the fix; nothing is written before the checks pass."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import fit, make_module

from lightning_smartinf.config import OffloadConfig, coerce
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy


def test_dict_and_dataclass_mean_the_same() -> None:
    assert coerce(OffloadConfig, {"nvme_path": "/x"}, "offload") == OffloadConfig(nvme_path="/x")


@pytest.mark.parametrize(
    ("settings", "message"),
    [({"params": "disk"}, "offload.params='disk'"), ({"subgroup_size": 5}, "offload.subgroup_size=5"),
     ({"bogus": 1}, "unknown offload keys")],
)  # fmt: skip
def test_bad_offload_settings(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SmartInfinityStrategy(offload=settings)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_unwritable_path(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="not writable"):
        fit(make_module(), SmartInfinityStrategy(offload={"nvme_path": str(locked / "s")}), max_steps=1)


def test_path_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"lies under .*file', which is a regular file, not a directory"):
        fit(make_module(), SmartInfinityStrategy(offload={"nvme_path": str(blocker / "s")}), max_steps=1)
    with pytest.raises(OSError, match=r"/file' is a regular file, not a directory: point offload.nvme_path"):
        fit(make_module(), SmartInfinityStrategy(offload={"nvme_path": str(blocker)}), max_steps=1)


def test_not_enough_space_fails_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    state = tmp_path / "state"
    with pytest.raises(OSError, match="offload.nvme_path=.* has 1000 B free but the offloaded state needs"):
        fit(make_module(), SmartInfinityStrategy(offload={"nvme_path": str(state)}), max_steps=1)
    assert not any(f.is_file() for f in state.rglob("*"))


def test_tmpfs_falls_back_to_buffered_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_smartinf.storage.io as io

    monkeypatch.setattr(io, "supports_o_direct", lambda _d: False)
    backend = io.make_backend("auto", tmp_path, 1, 1, 1 << 20, 8)
    assert "buffered" in backend.name
    with pytest.raises(ValueError, match="needs O_DIRECT"):
        io.make_backend("aio", tmp_path, 1, 1, 1 << 20, 8)


def test_io_settings_defaults_are_the_offload_configs() -> None:
    """storage/ takes plain settings, not the config: its defaults must stay the config's."""
    from lightning_smartinf.storage.io import IOSettings

    cfg = OffloadConfig()
    assert IOSettings() == IOSettings(cfg.io_backend, cfg.io_threads, cfg.aio_intra_op_parallelism,
                                      cfg.aio_block_size, cfg.aio_queue_depth)  # fmt: skip
