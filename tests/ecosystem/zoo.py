"""Tiny models of the libraries users bring (Hugging Face transformers, litgpt), random init, no downloads, each in
the LightningModule a user would write for plain Lightning: ``training_step`` calls the library's own forward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64))


def litgpt() -> nn.Module:
    from litgpt import GPT, Config

    return GPT(Config(n_layer=2, n_head=4, n_embd=32, block_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                      bias=False))


MODELS: dict[str, Callable[[], nn.Module]] = {"llama": llama, "gpt2": gpt2, "mixtral": mixtral, "litgpt": litgpt}


class CausalLM(pl.LightningModule):
    """A user's module around a library model: next-token loss through the model's own forward."""

    def __init__(self, family: str, seed: int = 0, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.family, self.lr = family, lr
        self.model = MODELS[family]()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.family == "litgpt":
            return self.model(tokens)  # type: ignore[no-any-return]
        return self.model(input_ids=tokens).logits  # type: ignore[no-any-return]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.family == "litgpt":
            logits = self.model(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        return self.model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.1)


def token_batches(samples: int = 24, seq_len: int = 16, batch_size: int = 2, seed: int = 0) -> Any:
    data = torch.randint(0, VOCAB, (samples, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)
