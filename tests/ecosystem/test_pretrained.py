"""Fine-tuning from a Hugging Face style directory (sharded safetensors + index, as ``save_pretrained`` writes):
built on meta, read tensor by tensor into storage, equal to plain Lightning fine-tuning of ``from_pretrained``; and
every broken input is an error before training that names the file and the tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F
from zoo import VOCAB, gpt2, llama, token_batches

from lightning_smartinf.cli.export import main as export_main
from lightning_smartinf.engine.pretrained import PretrainedError
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

pytest.importorskip("transformers")


class FineTune(pl.LightningModule):
    """A user's fine-tuning module: the model is made in configure_model (from a config, or from_pretrained)."""

    def __init__(self, source: Path, pretrained: bool) -> None:
        super().__init__()
        self.source, self.pretrained = source, pretrained
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.pretrained:
            self.model = AutoModelForCausalLM.from_pretrained(self.source)
        else:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.source))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def write(path: Path, family: str) -> Path:
    """A random-init tiny model written by save_pretrained in shards of a few KB (no download)."""
    torch.manual_seed(7)
    (llama if family == "llama" else gpt2)().save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write(tmp_path_factory.mktemp("llama"), "llama")


def fine_tune(strategy: Any, module: FineTune, steps: int = 5) -> pl.Trainer:
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         precision="32-true", limit_val_batches=0)  # fmt: skip
    trainer.fit(module, token_batches())
    return trainer


def smart(tmp_path: Path, init_from: Path) -> SmartInfinityStrategy:
    return SmartInfinityStrategy(
        offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads"},
        update={"host_adam": "torch"}, init_from=init_from,
    )  # fmt: skip


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fine_tuning_from_a_sharded_directory_equals_plain_lightning(tmp_path: Path, family: str) -> None:
    """GPT-2's file holds its tied head once (``transformer.wte.weight``): it serves ``lm_head.weight`` too."""
    checkpoint = write(tmp_path / family, family)
    reference = FineTune(checkpoint, pretrained=True)
    fine_tune("auto", reference)
    ours = FineTune(checkpoint, pretrained=False)
    trainer = fine_tune(smart(tmp_path, checkpoint), ours)
    plain = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)
    tokens = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        logits = ours.model(input_ids=tokens).logits
        torch.testing.assert_close(logits, reference.model(input_ids=tokens).logits, rtol=1e-4, atol=1e-5)
        assert F.cross_entropy(logits.reshape(-1, VOCAB), tokens.reshape(-1)).isfinite()
    # written out block by block, from the live strategy and from a checkpoint, in save_pretrained's layout
    from transformers import AutoModelForCausalLM

    live, saved = tmp_path / "live", tmp_path / "exported"
    trainer.strategy.export(live, strip_prefix="model.", max_shard_size="40KB")  # type: ignore[attr-defined]
    trainer.save_checkpoint(tmp_path / "ckpt")
    export_main([str(tmp_path / "ckpt"), str(saved), "--dtype", "fp32", "--strip-prefix", "model.",
                 "--max-shard-size", "40KB"])  # fmt: skip
    for out in (live, saved):
        assert (out / "model.safetensors.index.json").is_file()
        ours.model.config.save_pretrained(out)
        with torch.no_grad():
            loaded = AutoModelForCausalLM.from_pretrained(out)(input_ids=tokens).logits
        torch.testing.assert_close(loaded, logits, rtol=1e-5, atol=1e-6)


def broken(tmp_path: Path, checkpoint: Path, how: str) -> Path:
    import shutil

    target = tmp_path / "broken"
    shutil.copytree(checkpoint, target)
    shards = sorted(target.glob("model-*.safetensors"))
    if how == "missing shard":
        shards[1].unlink()
    elif how == "truncated shard":
        data = shards[0].read_bytes()
        shards[0].write_bytes(data[: len(data) - 100])
    elif how == "missing path":
        return tmp_path / "nowhere"
    return target


@pytest.mark.parametrize(("how", "message"), [
    ("missing path", r"init_from=.*nowhere does not exist"),
    ("missing shard", r"index.json lists shard model-00002-of-.*\.safetensors, which is not in"),
    ("truncated shard", r"model-00001-of-.*\.safetensors is truncated"),
])  # fmt: skip
def test_a_broken_directory_is_refused_naming_the_file(
    tmp_path: Path, checkpoint: Path, how: str, message: str
) -> None:  # fmt: skip
    with pytest.raises(PretrainedError, match=message):
        fine_tune(smart(tmp_path, broken(tmp_path, checkpoint, how)), FineTune(checkpoint, pretrained=False), 1)
    assert not any((tmp_path / "state").rglob("sg*")), "no state written"


def test_a_model_that_does_not_match_is_refused_naming_the_tensor(tmp_path: Path, checkpoint: Path) -> None:
    from transformers import AutoConfig

    other = tmp_path / "other"
    config = AutoConfig.from_pretrained(checkpoint)
    config.intermediate_size = 48
    config.save_pretrained(other)
    with pytest.raises(PretrainedError, match=r"mlp\.\w+_proj\.weight in .* has shape \[\d+, \d+\], model\.model\."):
        fine_tune(smart(tmp_path, checkpoint), FineTune(other, pretrained=False), 1)
