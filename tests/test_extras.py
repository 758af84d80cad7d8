"""The optional dependencies: a missing one falls back where the engine can, or stops with one line naming the extra.

The modules are installed here (the test extra brings them all), so their absence is simulated where the package
asks for them (``extras.available``, ``importlib.import_module``); a base install in a fresh virtualenv is the
README's own check (docs/default_run.md).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest

from lightning_smartinf import extras
from lightning_smartinf.errors import ConfigError
from lightning_smartinf.storage import io
from lightning_smartinf.update import cpu_adam


@pytest.fixture
def without(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``without("deepspeed")``: the package sees the module as not installed."""
    real = importlib.import_module

    def hide(*names: str) -> None:
        def fake(name: str, package: str | None = None):  # noqa: ANN202
            if name.split(".")[0] in names:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return real(name, package)

        monkeypatch.setattr(extras.importlib, "import_module", fake)

    return hide


def test_a_missing_module_is_one_line_naming_the_extra(without) -> None:  # noqa: ANN001
    without("matplotlib")
    assert not extras.available("matplotlib")
    with pytest.raises(ConfigError) as err:
        extras.pyplot("smartinf-plan --plot")
    assert str(err.value) == ("smartinf-plan --plot needs matplotlib, which is not installed: pip install "
                              "'lightning-smartinf[plots]'")  # fmt: skip


def test_without_deepspeed_the_io_falls_back_to_the_thread_pool_unless_aio_was_asked_for(
    without, tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: ANN001
) -> None:  # fmt: skip
    without("deepspeed")
    with caplog.at_level(logging.INFO):
        backend = io.make_backend("auto", tmp_path, 2, 1, 1 << 20, 32)
    try:
        assert isinstance(backend, io.ThreadPoolIO)
    finally:
        backend.close()
    assert "pip install 'lightning-smartinf[deepspeed]'; using the thread-pool backend" in caplog.text
    with pytest.raises(ConfigError, match=r"offload.io_backend=aio .* pip install 'lightning-smartinf\[deepspeed\]'"):
        io.make_backend("aio", tmp_path, 2, 1, 1 << 20, 32)


def test_without_deepspeed_adam_is_torchs_unless_deepspeeds_was_asked_for(without) -> None:  # noqa: ANN001
    without("deepspeed")
    assert cpu_adam.load_cpu_adam("auto") is None
    with pytest.raises(ConfigError, match=r"update.host_adam=deepspeed needs deepspeed"):
        cpu_adam.load_cpu_adam("deepspeed")


def test_without_pyopencl_smart_update_stops_naming_the_extra(without) -> None:  # noqa: ANN001
    from lightning_smartinf.update import opencl

    without("pyopencl")
    with pytest.raises(ConfigError, match=r"update=smart .* pip install 'lightning-smartinf\[smart\]'"):
        opencl.candidate_devices(opencl.DeviceSpec())
