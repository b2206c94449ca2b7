"""The pipeline model and the equivalence harness of AccelParallel's tests.

``fit_parallel`` runs ``Trainer.fit`` on one rank of an AccelParallel layout and returns every gradient it saw (full
tensors, by parameter name) and its parameters and optimizer state after the last step; ``fit_reference`` does the
same in this process on the joint batch, with a plain Lightning Trainer.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lit_accel import PipelineLoss
from tests.helpers.models import small_trainer_kwargs

__all__ = [
    "Block", "GradRecorder", "PipeModel", "TimmViT", "dataset", "fit_parallel", "fit_reference", "full",
    "image_dataset", "merge",
]  # fmt: skip

IN, OUT = 6, 3


class Block(nn.Module):
    """A residual MLP block: x + fc2(tanh(fc1(x)))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class PipeModel(PipelineLoss, pl.LightningModule):
    """embed -> blocks -> norm -> head; the loss declared once (``pipeline_loss``), SGD with momentum."""

    def __init__(self, depth: int = 4, width: int = 8, hidden: int = 16, lr: float = 0.1, norm: bool = True) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Linear(IN, width)
        self.blocks = nn.ModuleList([Block(width, hidden) for _ in range(depth)])
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.head = nn.Linear(width, OUT)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output.float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g))


VIT_IMAGE = 8  # the side of the images TimmViT takes (4 x 4 pixel patches: 4 patches and the class token)


def image_dataset(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, VIT_IMAGE, VIT_IMAGE, generator=g), torch.randn(n, OUT, generator=g))


class ViTEmbed(nn.Module):
    """What timm's ``VisionTransformer.forward_features`` runs before its blocks, folded into one pipeline unit: the
    patches, the class token and the position embedding (its default ``class_token=True``, no register tokens)."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.patch_embed, self.norm_pre = vit.patch_embed, vit.norm_pre
        self.cls_token, self.pos_embed = vit.cls_token, vit.pos_embed

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm_pre(x)


class ViTHead(nn.Module):
    """What timm's ViT runs after its blocks (``norm``, then ``forward_head`` with its default class-token pool)."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.norm, self.fc_norm, self.head = vit.norm, vit.fc_norm, vit.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.fc_norm(self.norm(x)[:, 0]))


class TimmViT(PipelineLoss, pl.LightningModule):
    """timm's ``VisionTransformer`` with the pipeline units docs/strategies.md asks for: ``embed``, its own
    ``blocks``, ``head``; the same weights as ``self.vit_forward``'s model, which gives the same output."""

    def __init__(
        self, depth: int = 2, lr: float = 0.1, image: int = VIT_IMAGE, width: int = 16, heads: int = 2
    ) -> None:  # fmt: skip
        super().__init__()
        from timm.models.vision_transformer import VisionTransformer

        self.lr = lr
        vit = VisionTransformer(img_size=image, patch_size=4, embed_dim=width, depth=depth, num_heads=heads,
                                num_classes=OUT)  # fmt: skip
        self.embed, self.blocks, self.head = ViTEmbed(vit), vit.blocks, ViTHead(vit)
        self.vit_forward = vit.forward  # timm's own forward on these very modules (not registered: no unit)

    def forward(self, images: Tensor) -> Tensor:
        x = self.embed(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output.float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class TorchvisionViTEmbed(nn.Module):
    """What torchvision's ``VisionTransformer.forward`` runs before its encoder's layers, folded into one pipeline
    unit: the patches (``_process_input``), the class token, the position embedding and the encoder's dropout."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.conv_proj, self.class_token = vit.conv_proj, vit.class_token
        self.pos_embedding, self.dropout = vit.encoder.pos_embedding, vit.encoder.dropout

    def forward(self, images: Tensor) -> Tensor:
        x = self.conv_proj(images).flatten(2).permute(0, 2, 1)  # (n, patches, hidden), as _process_input
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class TorchvisionViTHead(nn.Module):
    """What torchvision's ViT runs after its encoder's layers: the encoder's ``ln``, the class token, ``heads``."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.ln, self.heads = vit.encoder.ln, vit.heads

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.ln(x)[:, 0])


class TorchvisionViT(PipelineLoss, pl.LightningModule):
    """torchvision's ``VisionTransformer`` with the pipeline units docs/strategies.md asks for: ``embed``, its own
    ``encoder.layers`` as ``blocks``, ``head``; the same weights as ``self.vit_forward``'s model, same output."""

    def __init__(
        self, depth: int = 2, lr: float = 0.1, image: int = VIT_IMAGE, width: int = 16, heads: int = 2
    ) -> None:
        super().__init__()
        from torchvision.models import VisionTransformer

        self.lr = lr
        vit = VisionTransformer(image_size=image, patch_size=4, num_layers=depth, num_heads=heads, hidden_dim=width,
                                mlp_dim=2 * width, num_classes=OUT)  # fmt: skip
        self.embed, self.blocks, self.head = TorchvisionViTEmbed(vit), vit.encoder.layers, TorchvisionViTHead(vit)
        self.vit_forward = vit.forward  # torchvision's own forward on these very modules (not registered: no unit)

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.blocks(self.embed(images)))

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output.float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class TorchvisionResNet(PipelineLoss, pl.LightningModule):
    """torchvision's ``resnet18`` as its library defines it (BatchNorm in every block), SGD with momentum."""

    def __init__(self, depth: int = 0, lr: float = 0.1) -> None:  # depth: assert_equivalent's knob, unused
        super().__init__()
        from torchvision.models import resnet18

        self.lr = lr
        self.net = resnet18(num_classes=OUT)

    def forward(self, images: Tensor) -> Tensor:
        return self.net(images)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.mse_loss(output.float(), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def full(value: Tensor) -> Tensor:
    """A full CPU copy (a collective over its mesh for a DTensor: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()


class GradRecorder(pl.Callback):
    """Every optimizer step's gradients, full, by parameter name (after unscaling and clipping)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: Any) -> None:
        self.grads.append({n: full(p.grad) for n, p in module.named_parameters() if p.grad is not None})


def _result(trainer: pl.Trainer, module: pl.LightningModule, recorder: GradRecorder) -> dict[str, Any]:
    optimizer = trainer.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    momentum = {names[id(p)]: full(s["momentum_buffer"]) for p, s in optimizer.state.items() if "momentum_buffer" in s}
    params = {n: full(p) for n, p in module.named_parameters()}
    return {"grads": recorder.grads, "params": params, "momentum": momentum, "steps": trainer.global_step}


def fit_reference(samples: int, global_batch: int, steps: int, make_model: Any = PipeModel,
                  shuffle_seed: int | None = None, make_data: Any = dataset,
                  **trainer_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """One process, one batch of ``global_batch`` samples per step (shuffled per epoch as a seeded sampler would)."""
    pl.seed_everything(0, verbose=False)
    model = make_model()
    recorder = GradRecorder()
    kwargs = small_trainer_kwargs(max_steps=steps, max_epochs=-1, callbacks=[recorder])
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    data = make_data(samples)
    sampler = None if shuffle_seed is None else DistributedSampler(data, 1, 0, shuffle=True, seed=shuffle_seed)
    trainer.fit(model, DataLoader(data, batch_size=global_batch, shuffle=False, sampler=sampler))
    return _result(trainer, model, recorder)


def fit_parallel(rank: int, world: int, strategy_kwargs: dict[str, Any], samples: int, loaded: int, steps: int,
                 make_model: Any = PipeModel, make_data: Any = dataset, observe: Any = None,
                 **trainer_kwargs: Any) -> dict[str, Any]:  # fmt: skip
    """One rank of an AccelParallel fit; each data-parallel replica loads ``loaded`` samples per step.

    ``observe(model, strategy)``: a dict of what else to return, read after the fit. With
    ``use_distributed_sampler=True`` the loader is shuffled and Lightning gives it its own ``DistributedSampler``
    (over the strategy's ``distributed_sampler_kwargs``), as in a user's script.
    """
    from lit_accel import AccelParallel

    pl.seed_everything(0, verbose=False)
    model = make_model()
    strategy = AccelParallel(**strategy_kwargs)
    layout = strategy.plan.for_world("test", world).layout
    data = make_data(samples)
    sampler = DistributedSampler(data, layout.data, layout.data_rank(rank), shuffle=False)
    lightnings = trainer_kwargs.get("use_distributed_sampler", False)
    recorder = GradRecorder()
    kwargs = small_trainer_kwargs(devices=world, max_steps=steps, max_epochs=-1, use_distributed_sampler=False)
    kwargs.update(trainer_kwargs)
    kwargs["callbacks"] = [recorder, *kwargs.get("callbacks", [])]
    trainer = pl.Trainer(strategy=strategy, **kwargs)
    # shuffled, Lightning adds its own sampler; else the replica's part in order
    loader = DataLoader(data, batch_size=loaded, shuffle=lightnings, sampler=None if lightnings else sampler)
    trainer.fit(model, loader)
    result = _result(trainer, model, recorder)
    counters = ("rounds", "reduce_scatters", "all_gathers", "p2p_sends", "p2p_bytes")
    result["comm"] = {k: getattr(strategy.comm_stats, k) for k in counters}
    result["fsdp_groups"] = fsdp_groups(model, strategy)
    result["layout"] = strategy.layout
    result.update(observe(model, strategy) if observe is not None else {})
    return result


def fsdp_groups(model: nn.Module, strategy: Any) -> int:
    """FSDP parameter groups on this rank: FSDP modules (the model's and the stage roots) that own a parameter."""
    from torch.distributed.fsdp import FSDPModule

    stages = [] if strategy.pipeline is None else strategy.pipeline.modules
    modules = {id(m): m for root in [model, *stages] for m in root.modules() if isinstance(m, FSDPModule)}
    groups = 0
    for module in modules.values():
        nested = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
                  for p in sub.parameters()}  # fmt: skip
        groups += any(id(p) not in nested for p in module.parameters())
    return groups


def merge(results: list[dict[str, Any]], key: str) -> Any:
    """Union over ranks of a per-name result (``params``/``momentum``) or of each step's gradients (``grads``)."""
    if key == "grads":
        steps = len(results[0]["grads"])
        return [{n: g for r in results for n, g in r["grads"][i].items()} for i in range(steps)]
    return {n: v for r in results for n, v in r[key].items()}
