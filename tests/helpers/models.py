"""The one tiny model and data helpers shared by the tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

__all__ = ["BNModel", "make_dataset", "make_loader", "params_of", "small_trainer_kwargs"]


class BNModel(pl.LightningModule):
    """Linear -> BatchNorm1d -> ReLU -> Linear regression model, deterministic under a fixed seed.

    Args:
        in_features: input width.
        hidden: hidden width (the BatchNorm's channel count).
        out_features: output width.
        lr: SGD learning rate.
        optimizer: ``"sgd"``, ``"adamw"`` or ``"adamw_fused"``.
        batchnorm: include the BatchNorm layer.
    """

    def __init__(
        self,
        in_features: int = 8,
        hidden: int = 16,
        out_features: int = 4,
        lr: float = 0.1,
        optimizer: str = "sgd",
        batchnorm: bool = True,
    ) -> None:
        super().__init__()
        self.lr = lr
        self.optimizer_name = optimizer
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.BatchNorm1d(hidden) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr)
        if self.optimizer_name == "adamw_fused":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        raise ValueError(self.optimizer_name)


def make_dataset(n: int = 64, in_features: int = 8, out_features: int = 4, seed: int = 0) -> TensorDataset:
    """A fixed random regression data set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g) * 2.0 + 0.5
    y = torch.randn(n, out_features, generator=g)
    return TensorDataset(x, y)


def make_loader(
    dataset: TensorDataset, batch_size: int, rank: int | None = None, world_size: int | None = None
) -> DataLoader:
    """A sequential loader; with ``rank``/``world_size``, a non-shuffling ``DistributedSampler``.

    Equivalence tests need ``Trainer(use_distributed_sampler=False)`` together with this loader, because Lightning
    otherwise replaces the sampler with a shuffling one.
    """
    sampler = None
    if world_size is not None:
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False)


def small_trainer_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for a small, quiet CPU Trainer."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    kwargs.update(overrides)
    return kwargs


def params_of(module: nn.Module) -> dict[str, Tensor]:
    """A detached CPU copy of the module's state (parameters and buffers)."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
