"""Next-token batches as the data pipeline yields them, for every model the command line trains.

A batch is either a ``(b, t+1)`` tensor of token windows (text: every next token is a target) or a dict of
``tokens`` ``(b, t+1)`` and ``labels`` ``(b, t)`` (instruction data: the prompt and padding hold ``IGNORE_INDEX``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def inputs(batch: Any) -> torch.Tensor:
    """The ids the model reads: ``(b, t)``."""
    tokens = batch["tokens"] if isinstance(batch, dict) else batch
    return tokens[:, :-1]


def targets(batch: Any) -> torch.Tensor:
    """Each position's next token, or ``IGNORE_INDEX`` where the loss skips it: ``(b, t)``."""
    return batch["labels"] if isinstance(batch, dict) else batch[:, 1:]


def next_token_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Mean cross-entropy over the positions that count, in fp32: ``(b, t, vocab)`` logits against ``targets``."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets(batch).reshape(-1),
                           ignore_index=IGNORE_INDEX)  # fmt: skip


def tokens_in_batch(batch: Any) -> int:
    """Positions the model runs over, ``b * t`` (read by the progress monitor for tokens/s)."""
    ids = inputs(batch)
    return int(ids.shape[0] * ids.shape[1])
