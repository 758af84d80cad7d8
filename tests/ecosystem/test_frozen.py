"""PEFT LoRA as its users write it, over base weights that live on storage: the frozen weights of the streamed
blocks stream read-only (no master, no state, no gradient, no write-back), the adapters train as every trainable
parameter does, and the result equals plain Lightning + PEFT in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from zoo import VOCAB, token_batches

from lightning_smartinf.config import ScheduleConfig
from lightning_smartinf.core import FROZEN, HOST_LINK
from lightning_smartinf.lightning.strategy import SmartInfinityStrategy

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


class LoRAModule(pl.LightningModule):
    """A user's LoRA fine-tune: ``get_peft_model`` over a Hugging Face model, AdamW over what requires grad."""

    def __init__(self, arch: str, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.AutoConfig.for_model(arch, **SHAPE, tie_word_embeddings=arch == "qwen2")
        base = transformers.AutoModelForCausalLM.from_config(config)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               lora_dropout=0.0, init_lora_weights="gaussian")  # fmt: skip
        self.model = peft.get_peft_model(base, lora)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def fit(module: LoRAModule, strategy: Any, batch_size: int = 2, accumulate: int = 2) -> pl.Trainer:
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     precision="32-true", limit_val_batches=0, accumulate_grad_batches=accumulate)  # fmt: skip
    run.fit(module, token_batches(batch_size=batch_size))
    return run


def smart(tmp_path: Path, vertical: bool, budget: str = "0", update: str = "host") -> SmartInfinityStrategy:
    strategy = SmartInfinityStrategy(
        offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096, "io_backend": "threads",
                 "host_memory_budget": budget, **({"grads": "cpu"} if update == "smart" else {})},
        update={"host_adam": "torch"} if update == "host" else {"backend": "smart", "devices": 2},
    )  # fmt: skip
    strategy.schedule = ScheduleConfig("vertical", micro_batches=2) if vertical else ScheduleConfig("horizontal")
    return strategy


@pytest.mark.parametrize("vertical", [False, True], ids=["horizontal", "vertical"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_equals_plain_lightning_with_the_base_on_storage(tmp_path: Path, arch: str, vertical: bool) -> None:
    start = {k: v.clone() for k, v in LoRAModule(arch).state_dict().items()}
    reference = LoRAModule(arch)
    fit(reference, "auto")
    ours = LoRAModule(arch)
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            base = pl_module.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
            seen["resident_numel"] = base.data.numel()  # empty between block calls: it lives on storage

    run = pl.Trainer(strategy=smart(tmp_path, vertical), accelerator="cpu", devices=1, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     precision="32-true", limit_val_batches=0, accumulate_grad_batches=1 if vertical else 2,
                     callbacks=[Probe()])  # fmt: skip
    run.fit(ours, token_batches(batch_size=4 if vertical else 2))
    assert seen["resident_numel"] == 0
    engine = run.strategy.engine  # type: ignore[attr-defined]
    frozen_numel = sum(s.numel for b in engine.frozen_layout.streamed for s in b.slots)
    layer_base = sum(p.numel() for n, p in reference.model.base_model.model.model.layers.named_parameters()
                     if "lora_" not in n)  # fmt: skip
    assert frozen_numel == layer_base  # every base weight of the blocks, none of the adapters
    reads = engine.counters.table()[f"{HOST_LINK}/read"]
    passes = 2 * (1 if vertical else 2) * 3  # forward and backward, per micro-batch (horizontal) or per step
    passes += 1  # and once more as fit ends, into the module (offload.return_weights)
    assert reads[FROZEN] == passes * frozen_numel * 4  # fp32 weights, read and never written
    assert engine.counters.table()[f"{HOST_LINK}/write"][FROZEN] == frozen_numel * 4  # once, at set-up
    plain = reference.state_dict()
    for name, value in ours.state_dict().items():
        if "lora_" in name:
            torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(value, start[name]), name  # the base, bit for bit as it started
    assert any(not torch.equal(v, start[k]) for k, v in plain.items() if "lora_" in k)


@pytest.mark.parametrize("where", ["host memory budget", "update=smart"])
def test_lora_with_the_base_in_the_budget_or_the_update_on_devices(tmp_path: Path, where: str) -> None:
    """The frozen base placed in host memory by offload.host_memory_budget (no disk reads for it), or the adapters
    updated by SmartUpdate's OpenCL kernels: the same training either way."""
    reference = LoRAModule("llama")
    fit(reference, "auto")
    ours = LoRAModule("llama")
    in_budget = where == "host memory budget"
    run = fit(ours, smart(tmp_path, False, "64MB") if in_budget else smart(tmp_path, False, update="smart"))
    engine = run.strategy.engine  # type: ignore[attr-defined]
    reads = engine.counters.table().get(f"{HOST_LINK}/read", {})  # with everything in RAM, no storage reads at all
    if in_budget:
        assert len(engine.placement.frozen) == len(engine.frozen_layout.subgroups) and FROZEN not in reads
        assert "frozen weights of" in engine.placement.describe(engine.layout, engine.frozen_layout)
    else:
        assert reads[FROZEN] > 0
    plain = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_adapter_saves_as_peft_writes_it(tmp_path: Path) -> None:
    ours = LoRAModule("llama")
    fit(ours, smart(tmp_path, vertical=False))
    ours.model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    fresh = LoRAModule("llama")  # the same base (seeded), untrained adapters
    loaded = peft.PeftModel.from_pretrained(fresh.model.base_model.model, tmp_path / "adapter")
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, ours.model(input_ids=tokens).logits)


def test_export_streams_base_and_adapters_and_merges_them(tmp_path: Path) -> None:
    """strategy.export writes base and adapters block by block; with merge_adapters, the merged model as
    merge_and_unload makes it, which from_pretrained loads."""
    from safetensors.torch import load_file

    ours = LoRAModule("llama")
    run = fit(ours, smart(tmp_path, vertical=False))
    files = run.strategy.export(tmp_path / "export")  # type: ignore[attr-defined]
    exported = {k: v for f in files for k, v in load_file(f).items()}
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(exported[name], value, msg=name)
    merged_dir = tmp_path / "merged"
    run.strategy.export(merged_dir, strip_prefix="model.", merge_adapters=True)  # type: ignore[attr-defined]
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = ours.model(input_ids=tokens).logits
    reference = ours.model.merge_and_unload().state_dict()
    merged = load_file(merged_dir / "model.safetensors")
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    ours.model.config.save_pretrained(merged_dir)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(merged_dir)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-5)


def test_frozen_weights_changed_between_stages_are_refused(tmp_path: Path) -> None:
    module = LoRAModule("llama")
    run = fit(module, smart(tmp_path, vertical=False))
    base = module.model.base_model.model.model.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(ValueError, match=r"frozen parameter .*layers\.1\.mlp\.up_proj\.weight changed"):
        run.validate(module, token_batches(samples=4), verbose=False)


def test_requires_grad_changed_between_stages_takes_effect_at_the_next_set_up(tmp_path: Path) -> None:
    """Unfreeze the second layer's MLP after a LoRA stage: the next fit trains it, as plain Lightning does."""
    reference, ours = LoRAModule("llama"), LoRAModule("llama")
    runs = [(reference, "auto"), (ours, smart(tmp_path, vertical=False))]
    for module, strategy in runs:
        run = fit(module, strategy)
        module.model.base_model.model.model.layers[1].mlp.requires_grad_(True)
        run.fit_loop.epoch_loop.max_steps = 6
        run.fit(module, token_batches(batch_size=2))
    plain = reference.state_dict()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any("layers.1.mlp" in s.name for s in run.strategy.engine.layout.streamed[1].slots)  # type: ignore[attr-defined]


def test_validate_of_a_model_built_on_meta_streams_it_from_storage(tmp_path: Path) -> None:
    """Before any fit: built on meta, its weights read from a sharded directory into storage, validated there."""
    source = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SHAPE))
    source.save_pretrained(tmp_path / "hf", max_shard_size="40KB")

    class Eval(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.AutoModelForCausalLM.from_config(source.config)

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    plain = Eval()
    plain.model.load_state_dict(source.state_dict())
    loader = token_batches(samples=8)
    expected = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).validate(plain, loader)
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096,
                                              "io_backend": "threads", "host_memory_budget": "0"},
                                     init_from=tmp_path / "hf")  # fmt: skip
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     precision="32-true")  # fmt: skip
    with run.init_module(empty_init=True):
        ours = Eval()
    assert ours.model.model.layers[0].mlp.up_proj.weight.is_meta
    got = run.validate(ours, loader, verbose=False)
    assert abs(got[0]["val_loss"] - expected[0]["val_loss"]) < 1e-5
    reads = run.strategy.engine.counters.table()[f"{HOST_LINK}/read"]  # type: ignore[attr-defined]
    assert reads["param"] > 0 and "master" not in reads  # streamed from storage, no optimizer state


def test_lora_on_a_model_built_on_meta_takes_its_base_from_init_from(tmp_path: Path) -> None:
    """The base read block by block from a sharded directory (PEFT's ``base_layer`` names mapped to the file's),
    the adapters given PEFT's own init (B zero: before training the model is its base), then trained."""
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SHAPE))
    source.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    loader = token_batches(samples=8)

    def build() -> LoRAModule:
        module = LoRAModule.__new__(LoRAModule)
        pl.LightningModule.__init__(module)
        base = transformers.AutoModelForCausalLM.from_config(source.config)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        module.model = peft.get_peft_model(base, lora)
        return module

    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state"), "subgroup_size": 4096,
                                              "io_backend": "threads", "host_memory_budget": "0"},
                                     update={"host_adam": "torch"}, init_from=tmp_path / "hf")  # fmt: skip
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     precision="32-true", limit_val_batches=4)  # fmt: skip
    with run.init_module(empty_init=True):
        ours = build()
    assert ours.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.is_meta
    before = run.validate(ours, loader, verbose=False)[0]["val_loss"]
    plain = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, limit_val_batches=4)
    base_module = LoRAModule.__new__(LoRAModule)
    pl.LightningModule.__init__(base_module)
    base_module.model = source
    assert abs(before - plain.validate(base_module, loader, verbose=False)[0]["val_loss"]) < 1e-5
    run.fit(ours, token_batches())
    trained = ours.model.base_model.model.state_dict()
    for name, value in source.state_dict().items():
        key = name.replace("q_proj.weight", "q_proj.base_layer.weight").replace("v_proj.weight",
                                                                                 "v_proj.base_layer.weight")
        assert torch.equal(trained[key], value), name
    assert any(float(v.abs().sum()) > 0 for k, v in trained.items() if "lora_B" in k)  # the adapters trained


def test_adapters_over_a_directory_without_their_base_weight_name_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **SHAPE))
    source.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    strategy = SmartInfinityStrategy(offload={"nvme_path": str(tmp_path / "state"), "io_backend": "threads"},
                                     update={"host_adam": "torch"}, init_from=tmp_path / "hf")  # fmt: skip
    run = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with run.init_module(empty_init=True):
        module = LoRAModule.__new__(LoRAModule)
        pl.LightningModule.__init__(module)
        lora = peft.LoraConfig(r=4, target_modules=["v_proj"])
        module.model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(source.config), lora)
    with pytest.raises(ValueError, match=r"no tensor for parameter .*layers\.1\.self_attn\.v_proj\.base_layer\."
                                         r"weight \(looked for 'model\.layers\.1\.self_attn\.v_proj\.weight'\)"):
        run.fit(module, token_batches())


def test_a_lora_checkpoint_holds_its_base_exports_and_resumes_without_it(tmp_path: Path) -> None:
    """The checkpoint holds the streamed blocks' frozen base beside the adapters: ``smartinf-export`` writes the
    whole model, the merged one (as merge_and_unload makes it) or the adapters alone from it, without the model's
    code; and a resume takes the base from the checkpoint, not from the module, so a changed base at resume still
    continues the run that was saved (on 2 near-storage devices, re-cut from 1 host state directory)."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from safetensors.torch import load_file

    from lightning_smartinf.cli.export import main as export

    def trainer(steps: int, strategy: Any) -> pl.Trainer:
        ckpts = ModelCheckpoint(dirpath=Path(strategy.offload.nvme_path).parent / "ckpts", every_n_train_steps=2)
        return pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
                          callbacks=[ckpts],
                          enable_progress_bar=False, enable_model_summary=False, precision="32-true",
                          limit_val_batches=0)  # fmt: skip

    straight = LoRAModule("llama")
    trainer(4, smart(tmp_path / "a", vertical=False)).fit(straight, token_batches(samples=4))
    split = LoRAModule("llama")
    trainer(2, smart(tmp_path / "b", vertical=False)).fit(split, token_batches(samples=4))
    checkpoint = tmp_path / "b" / "ckpts" / "epoch=0-step=2.ckpt"
    assert list((checkpoint / "offload" / "frozen").iterdir())

    export([str(checkpoint), str(tmp_path / "whole.safetensors"), "--dtype", "fp32"])
    whole = load_file(tmp_path / "whole.safetensors")
    assert whole.keys() == split.state_dict().keys()
    for name, value in split.state_dict().items():
        assert torch.equal(whole[name], value), name
    export([str(checkpoint), str(tmp_path / "merged"), "--dtype", "fp32", "--merge", "--strip-prefix", "model."])
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    reference = split.model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
    export([str(checkpoint), str(tmp_path / "adapters.safetensors"), "--adapters-only"])
    adapters = load_file(tmp_path / "adapters.safetensors")
    assert adapters and all("lora_" in name for name in adapters)

    changed = LoRAModule("llama", seed=5)  # another base (and other adapters, which the checkpoint replaces)
    strategy = smart(tmp_path / "c", vertical=False, update="smart")
    trainer(4, strategy).fit(changed, token_batches(samples=4), ckpt_path=checkpoint)
    got, expected = changed.state_dict(), straight.state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
