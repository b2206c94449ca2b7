"""A GPT-style language model (nanoGPT's layout: token and position embeddings, pre-norm causal blocks, tied-free
head) with the pipeline units docs/strategies.md asks for, and its token dataset.

Its projections carry the names the tensor plan's ``"auto"`` recognises (``q_proj``/``k_proj``/``v_proj``/
``out_proj`` with ``n_head``; an MLP ``fc`` -> GELU -> ``proj``), as LLaMA-style models name them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from lit_accel import PipelineLoss

__all__ = ["GPT", "token_dataset"]

VOCAB, CONTEXT = 61, 16


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        # -1: a tensor-parallel rank holds n_head / tp heads of the same head width
        q, k, v = (proj(x).view(n, t, self.n_head, -1).transpose(1, 2) for proj in (self.q_proj, self.k_proj,
                                                                                    self.v_proj))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(n, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), CausalSelfAttention(width, heads)
        self.ln_2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))


class Head(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(PipelineLoss, pl.LightningModule):
    """``embed`` -> ``blocks`` -> ``head``; next-token cross-entropy, AdamW."""

    def __init__(self, depth: int = 4, width: int = 32, heads: int = 4, vocab: int = VOCAB,
                 context: int = CONTEXT) -> None:  # fmt: skip
        super().__init__()
        self.embed = Embed(vocab, context, width)
        self.blocks = nn.ModuleList([GPTBlock(width, heads) for _ in range(depth)])
        self.head = Head(vocab, width)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def token_dataset(n: int, seed: int = 0, vocab: int = VOCAB, context: int = CONTEXT) -> TensorDataset:
    """``n`` random sequences and the same shifted by one token (the next-token targets)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (n, context + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])
