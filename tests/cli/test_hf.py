"""smartinf-train on real models and text: a local Hugging Face checkpoint and its BPE tokenizer in (made here, no
download), fine-tuned exactly as plain Lightning fine-tunes ``from_pretrained``, a ``save_pretrained`` directory out;
instruction data masked on the prompt; every bad input an error before any state is written."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_smartinf.cli.config import TrainConfig, register_configs
from lightning_smartinf.cli.models import choose_model
from lightning_smartinf.cli.train import run
from lightning_smartinf.data.corpus import TextDataModule
from lightning_smartinf.data.tokenizer import HFTokenizer
from lightning_smartinf.ecosystem.tiny import make_model, make_tokenizer, stdlib_texts
from lightning_smartinf.errors import ConfigError, SmartInfError
from lightning_smartinf.models.hf import HFCausalLM
from lightning_smartinf.models.loss import IGNORE_INDEX
from lightning_smartinf.resources import asset_dir

transformers = pytest.importorskip("transformers")
register_configs()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A BPE tokenizer, a sharded tiny Llama and a tiny Qwen2 (tied embeddings) beside it, a text corpus and
    instruction files."""
    root = tmp_path_factory.mktemp("hf")
    tokenizer = make_tokenizer(root / "llama", vocab=384, sample_bytes=400_000)
    for arch in ("llama", "qwen2"):
        tokenizer.save_pretrained(root / arch)
        # the embedding padded past the tokenizer's ids, as released models pad theirs (Qwen2's adds one)
        make_model(root / arch, arch, len(tokenizer) + 64, shard="60KB", eos_token_id=tokenizer.eos_token_id)
    assert len(list((root / "llama").glob("model-*.safetensors"))) > 1
    data = root / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("".join(stdlib_texts(60_000)))
    rows = [{"prompt": f"Add {i} and {i}. ", "response": f"{i} + {i} = {2 * i}"} for i in range(60)]
    (data / "instruct.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats = [{"messages": [{"role": "user", "content": f"Double {i}"}, {"role": "assistant", "content": str(2 * i)}]}
             for i in range(60)]  # fmt: skip
    (data / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    return {"root": root, "llama": root / "llama", "qwen2": root / "qwen2", "text": data / "corpus.txt",
            "instruct": data / "instruct.jsonl", "chat": data / "chat.jsonl"}  # fmt: skip


def compose_cfg(tmp_path: Path, *overrides: str) -> TrainConfig:
    base = ["trainer.precision=32-true", "trainer.max_steps=4", "trainer.limit_val_batches=2",
            "trainer.log_every_n_steps=1", "trainer.save_final=false", "data.seq_len=32", "data.batch_size=2",
            "update.host_adam=torch", "offload.io_backend=threads", "offload.host_memory_budget=0",
            f"offload.nvme_path={tmp_path / 'state'}", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    with initialize_config_dir(str(asset_dir("conf")), version_base=None):
        cfg = compose("config", overrides=[*base, *overrides])
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def plain_fine_tune(cfg: TrainConfig, checkpoint: Path) -> HFCausalLM:
    """Plain Lightning (no strategy) fine-tuning ``from_pretrained`` on the same token windows."""
    pl.seed_everything(cfg.trainer.seed, workers=True)
    spec = choose_model(cfg)
    module = HFCausalLM(transformers.AutoConfig.from_pretrained(checkpoint), lr=cfg.optim.lr,
                        weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.95))  # fmt: skip
    module.model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(checkpoint).state_dict())
    d = cfg.data
    data = TextDataModule(d.path, d.seq_len, d.batch_size, d.val_percent, d.train_samples, d.val_samples,
                          0, cfg.trainer.seed, spec.tokenizer, d.cache_dir)  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=cfg.trainer.max_steps, precision="32-true",
                         gradient_clip_val=cfg.trainer.gradient_clip_val, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(module, datamodule=data)
    return module


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cli_fine_tune_equals_plain_lightning_and_the_directory_round_trips(made, tmp_path: Path, arch: str) -> None:
    cfg = compose_cfg(tmp_path, "model=hf", f"model.path={made[arch]}", f"data.path={made['text']}")
    result = run(cfg, tmp_path / "run")
    assert result is not None and result["model"] == str(tmp_path / "run" / "model")
    out = Path(str(result["model"]))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    ours = transformers.AutoModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == len(transformers.AutoTokenizer.from_pretrained(made[arch]))
    assert ours.config.model_type == arch
    reference = plain_fine_tune(cfg, made[arch]).model
    start = transformers.AutoModelForCausalLM.from_pretrained(made[arch]).state_dict()
    theirs = reference.state_dict()
    for name, value in ours.state_dict().items():
        assert torch.allclose(value, theirs[name], rtol=1e-5, atol=1e-6), name
    assert any(not torch.equal(v, start[k]) for k, v in theirs.items())  # it did train
    ids = tokenizer("def main():", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_an_architecture_trains_from_scratch_with_its_own_init(tmp_path: Path) -> None:
    """No model.path: built on meta from model.config, initialized block by block by the model's _init_weights."""
    config = ("+model.config={model_type: llama, vocab_size: 256, hidden_size: 64, intermediate_size: 128, "
              "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}")
    result = run(compose_cfg(tmp_path, "model=hf", config, "trainer.max_steps=2", "optim.lr=1e-6"), tmp_path / "run")
    assert result is not None and result["token"] == "byte"
    model = transformers.AutoModelForCausalLM.from_pretrained(result["model"])
    layer = model.model.layers[1]
    assert abs(float(layer.self_attn.q_proj.weight.std()) - model.config.initializer_range) < 2e-3
    assert torch.allclose(layer.input_layernorm.weight, torch.ones(64), atol=1e-4)


def test_instruction_rows_train_on_the_response_only(made, tmp_path: Path) -> None:
    tokenizer = HFTokenizer(str(made["llama"]))
    data = TextDataModule(str(made["instruct"]), seq_len=48, batch_size=2, val_percent=10, train_samples=8,
                          val_samples=2, tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    data.setup()
    assert data.kind == "instruction"
    for i in range(len(data.train)):  # type: ignore[arg-type]
        sample = data.train[i]  # type: ignore[index]
        tokens, labels = sample["tokens"], sample["labels"]
        text = tokenizer.hf.decode(tokens[tokens != tokenizer.eos_id])
        prompt, response = text.split(". ", 1)[0] + ". ", text.split(". ", 1)[1]
        trained = labels[labels != IGNORE_INDEX]
        assert tokenizer.hf.decode(trained) == response + "<|end|>"  # the response and its EOS, nothing else
        n_prompt = len(tokenizer.hf(prompt, add_special_tokens=False).input_ids)
        assert (labels[: n_prompt - 1] == IGNORE_INDEX).all()  # targets inside the prompt are skipped
        assert torch.equal(labels[labels != IGNORE_INDEX], tokens[1:][labels != IGNORE_INDEX])


def test_chat_rows_train_on_the_assistant_turns(made, tmp_path: Path) -> None:
    tokenizer = HFTokenizer(str(made["llama"]))
    data = TextDataModule(str(made["chat"]), seq_len=32, batch_size=2, val_percent=10, train_samples=4,
                          val_samples=2, tokenizer=tokenizer, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    data.setup()
    sample = data.train[0]  # type: ignore[index]
    trained = tokenizer.hf.decode(sample["labels"][sample["labels"] != IGNORE_INDEX])
    whole = tokenizer.hf.decode(sample["tokens"])
    assert whole.startswith("<|user|>Double ") and trained.startswith("<|assistant|>") and "Double" not in trained


def test_instruction_fine_tune_from_the_command_line(made, tmp_path: Path) -> None:
    cfg = compose_cfg(tmp_path, "model=hf", f"model.path={made['llama']}", f"data.path={made['instruct']}",
                      "schedule=vertical", "schedule.micro_batches=2")  # fmt: skip
    result = run(cfg, tmp_path / "run")
    assert result is not None and result["summary"]["optimizer_steps"] == 4  # type: ignore[index]
    assert Path(str(result["model"]), "config.json").is_file()


def test_the_token_cache_is_built_once_and_keyed_on_the_files(made, tmp_path: Path, caplog) -> None:
    text = tmp_path / "a.txt"
    text.write_text("".join(stdlib_texts(20_000)))
    tokenizer = HFTokenizer(str(made["llama"]))

    def setup() -> TextDataModule:
        data = TextDataModule(str(text), seq_len=16, tokenizer=tokenizer, train_samples=4, val_samples=2)
        data.setup()
        return data

    with caplog.at_level(logging.INFO, "lightning_smartinf.data.tokens"):
        first = setup()
        second = setup()
    assert [r.getMessage().split(" ")[0] for r in caplog.records].count("tokenizing") == 1
    assert (tmp_path / ".smartinf_cache").is_dir()  # beside the data
    assert torch.equal(first.train[0], second.train[0])  # type: ignore[index]
    text.write_text(text.read_text() + "more")
    caplog.clear()
    with caplog.at_level(logging.INFO, "lightning_smartinf.data.tokens"):
        setup()
    assert any(r.getMessage().startswith("tokenizing") for r in caplog.records)
    assert len(list((tmp_path / ".smartinf_cache").glob("tokens-*"))) == 2


def test_a_gpt_recipe_takes_its_vocabulary_from_the_tokenizer(made, tmp_path: Path, caplog) -> None:
    spec = choose_model(compose_cfg(tmp_path, "recipe=gpt_125m", f"data.tokenizer={made['llama']}"))
    assert spec.build().cfg.vocab_size == 384  # 384 ids, already a multiple of 64
    with pytest.raises(ConfigError, match="has 384 ids, more than model.vocab_size=300"):
        choose_model(compose_cfg(tmp_path, f"data.tokenizer={made['llama']}", "model.vocab_size=300"),
                     frozenset({"model.vocab_size"}))  # fmt: skip
    with caplog.at_level(logging.WARNING, "smartinf-train"):
        choose_model(compose_cfg(tmp_path, "recipe=gpt_125m"))
    assert "declares 50,304 token ids, but data.tokenizer is bytes" in caplog.text


def _fails(tmp_path: Path, match: str, *overrides: str) -> None:
    cfg = compose_cfg(tmp_path, *overrides)
    with pytest.raises(SmartInfError, match=match):
        run(cfg, tmp_path / "run")
    assert not (tmp_path / "state").exists(), "state was written before the error"


def test_bad_model_directories_fail_before_any_state(made, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(tmp_path, "has no config.json", "model=hf", f"model.path={empty}", f"data.path={made['text']}")
    (empty / "config.json").write_text((made["llama"] / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"pickle")
    _fails(tmp_path, "holds no safetensors weights .*pytorch_model.bin", "model=hf", f"model.path={empty}")
    _fails(tmp_path, "not a local directory .*nothing is downloaded", "model=hf", "model.path=meta-llama/Llama-3-8B")
    small = tmp_path / "small"
    make_model(small, "llama", 256)
    _fails(tmp_path, r"has 384 ids, more than the model's vocab_size", "model=hf", f"model.path={small}",
           f"data.tokenizer={made['llama']}", f"data.path={made['text']}")  # fmt: skip
    _fails(tmp_path, "data.seq_len=512 is longer than the model's context, max_position_embeddings=256",
           "model=hf", f"model.path={made['llama']}", "data.seq_len=512")  # fmt: skip


def test_bad_data_fails_before_any_state_naming_the_file_and_line(made, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"question": "a"}\n')
    _fails(tmp_path, f"{bad}:2: a row needs", "model=hf", f"model.path={made['llama']}", f"data.path={bad}")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(tmp_path, "training split holds 0 tokens, fewer than data.seq_len", "model=hf",
           f"model.path={made['llama']}", f"data.path={empty}")


def test_without_transformers_model_hf_names_the_extra(made, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    _fails(tmp_path, r"pip install 'lightning-smartinf\[hf\]'", "model=hf", f"model.path={made['llama']}")


def test_lora_from_the_command_line_writes_an_adapter_that_from_pretrained_loads(made, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    cfg = compose_cfg(tmp_path, "model=hf", f"model.path={made['llama']}", "peft=lora", "peft.r=4",
                      "peft.target_modules=[q_proj,v_proj]", f"data.path={made['instruct']}")  # fmt: skip
    result = run(cfg, tmp_path / "run")
    assert result is not None
    traffic = result["summary"]["traffic_bytes"]["host/read"]  # type: ignore[index]
    assert traffic["frozen"] > traffic["param"] > 0  # the base streams read-only; only the adapters train
    out = Path(str(result["model"]))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out)  # the base from model.path, then the adapter
    base = transformers.AutoModelForCausalLM.from_pretrained(made["llama"]).state_dict()
    state = tuned.state_dict()
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    assert float(state["model.layers.1.self_attn.v_proj.lora_B.default.weight"].abs().sum()) > 0
    assert not any("k_proj.lora" in k for k in state)


def test_a_lora_target_that_matches_nothing_is_one_line_before_any_state(made, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    _fails(tmp_path, r"peft.target_modules=\['qkv'\]: .*", "model=hf", f"model.path={made['llama']}", "peft=lora",
           "peft.target_modules=[qkv]", f"data.path={made['text']}")  # fmt: skip
    _fails(tmp_path, "peft=lora adapts a Hugging Face model", "peft=lora")


def test_lora_with_merge_writes_the_merged_model_beside_the_adapter(made, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    cfg = compose_cfg(tmp_path, "model=hf", f"model.path={made['llama']}", "peft=lora", "peft.r=4", "peft.merge=true",
                      f"data.path={made['text']}")  # fmt: skip
    result = run(cfg, tmp_path / "run")
    assert result is not None and Path(str(result["model"])).name == "model"
    merged = transformers.AutoModelForCausalLM.from_pretrained(result["model"])
    assert not any("lora" in k for k in merged.state_dict())
    with_adapter = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "adapter")
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
