"""Data for ``examples/vit.py``: scikit-learn's handwritten digits, synthetic ImageNet-shaped images, ImageFolder trees.

Kept out of ``vit.py`` so that the training script reads as the case study it is. Every dataset here is built the same
way on every rank (no randomness that depends on the process), because Lightning's distributed sampler shards the
*same* dataset across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

__all__ = [
    "DIGITS_SPLIT_SEED",
    "DataSpec",
    "ImageDataModule",
    "ResumableLoader",
    "SyntheticImages",
    "check_image_folder",
    "digits_datasets",
    "folder_datasets",
    "synthetic_datasets",
]

# The train/val split of the digits is fixed, independent of ``--seed``: accuracy numbers stay comparable across runs.
DIGITS_SPLIT_SEED = 0
DIGITS_VAL_FRACTION = 0.2
# Synthetic data: ImageNet-1k's shape (1,281,167 training images, 1,000 classes); a short validation set so that the
# closing validation pass stays cheap.
SYNTHETIC_TRAIN_SAMPLES = 1_281_167
SYNTHETIC_VAL_SAMPLES = 1024
SYNTHETIC_NUM_CLASSES = 1000
# Distinct images behind the synthetic dataset. Indexing a small pool costs a memcpy per sample, so the loader measures
# the collate / pin / host-to-device path of a real pipeline without paying for random number generation.
SYNTHETIC_POOL = 256


@dataclass(frozen=True)
class DataSpec:
    """What the model needs to know about a dataset.

    Attributes:
        train: the training dataset, returning ``(image float tensor [C, H, W], label int)``.
        val: the validation dataset.
        num_classes: number of classes.
        in_chans: image channels.
        description: one line for the run summary.
    """

    train: Dataset
    val: Dataset
    num_classes: int
    in_chans: int
    description: str


def digits_datasets(img_size: int) -> DataSpec:
    """Scikit-learn's 1,797 real 8x8 handwritten digits, upsampled to ``img_size`` and split 80/20 (stratified).

    The images are scaled to [0, 1], upsampled with bilinear interpolation and standardised with the *training* set's
    mean and standard deviation (no statistic of the validation set leaks into training). One channel: the models are
    built with ``in_chans=1``.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, val_idx = train_test_split(
        torch.arange(len(labels)).numpy(),
        test_size=DIGITS_VAL_FRACTION,
        stratify=digits.target,
        random_state=DIGITS_SPLIT_SEED,
    )
    images = F.interpolate(images, size=(img_size, img_size), mode="bilinear", align_corners=False)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    train = TensorDataset(images[train_idx], labels[train_idx])
    val = TensorDataset(images[val_idx], labels[val_idx])
    return DataSpec(
        train=train,
        val=val,
        num_classes=10,
        in_chans=1,
        description=f"scikit-learn digits: {len(train)} train / {len(val)} val 8x8 images upsampled to {img_size}px",
    )


class SyntheticImages(Dataset):
    """Random ImageNet-shaped images with labels that a model can memorise (throughput runs, no download).

    Sample ``i`` is pool image ``i % pool`` with label ``(i % pool) % num_classes``: deterministic, identical on every
    rank, and learnable, so the loss goes down and the accuracy goes up, which is all synthetic data can show.
    """

    def __init__(self, num_samples: int, img_size: int, num_classes: int, in_chans: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.num_samples = num_samples
        self.num_classes = num_classes
        pool = min(SYNTHETIC_POOL, num_samples)
        self.images = torch.randn(pool, in_chans, img_size, img_size, generator=generator)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        slot = index % len(self.images)
        return self.images[slot], slot % self.num_classes


def synthetic_datasets(img_size: int, num_samples: int = SYNTHETIC_TRAIN_SAMPLES) -> DataSpec:
    """Synthetic ImageNet-shaped data: ``num_samples`` training images, 1,000 classes, 3 channels."""
    val_samples = min(SYNTHETIC_VAL_SAMPLES, num_samples)
    return DataSpec(
        train=SyntheticImages(num_samples, img_size, SYNTHETIC_NUM_CLASSES),
        val=SyntheticImages(val_samples, img_size, SYNTHETIC_NUM_CLASSES),
        num_classes=SYNTHETIC_NUM_CLASSES,
        in_chans=3,
        description=(
            f"synthetic ImageNet-shaped data: {num_samples:,} train / {val_samples:,} val images of "
            f"3x{img_size}x{img_size}, {SYNTHETIC_NUM_CLASSES} classes (a throughput run: accuracy shows memorisation)"
        ),
    )


def check_image_folder(root: str | Path) -> str | None:
    """Return why ``root`` is not an ImageFolder tree with ``train/`` and ``val/`` class folders, or ``None``."""
    root = Path(root)
    if not root.is_dir():
        return f"--data {str(root)!r} is neither 'synthetic', 'digits' nor an existing directory"
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir():
            return f"--data {str(root)!r} has no {split}/ folder (expected {split}/<class>/<image files>)"
        if not any(child.is_dir() for child in split_dir.iterdir()):
            return f"--data {str(root)!r}: {split}/ has no class folders (expected {split}/<class>/<image files>)"
    return None


def folder_datasets(root: str | Path, pretrained_cfg: dict[str, Any], img_size: int) -> DataSpec:
    """An ImageFolder tree (``root/train/<class>/...``, ``root/val/<class>/...``) with timm's standard transforms.

    ``timm.data.resolve_data_config`` picks the normalisation and interpolation from the model's ``pretrained_cfg``
    (``timm.get_pretrained_cfg(name).to_dict()``; ImageNet's defaults when empty); ``create_transform`` gives timm's
    training recipe (random-resized crop, flip, colour jitter) for ``train``, resize + centre crop for ``val``.

    Raises:
        ValueError: if ``train/`` and ``val/`` do not have the same class folders.
    """
    from timm.data import create_transform, resolve_data_config
    from torchvision.datasets import ImageFolder

    root = Path(root)
    config = resolve_data_config({"input_size": (3, img_size, img_size)}, pretrained_cfg=pretrained_cfg)
    train = ImageFolder(str(root / "train"), transform=create_transform(**config, is_training=True))
    val = ImageFolder(str(root / "val"), transform=create_transform(**config, is_training=False))
    if train.classes != val.classes:
        raise ValueError(
            f"--data {str(root)!r}: train/ has {len(train.classes)} classes and val/ has {len(val.classes)} "
            "with different names; both must hold the same class folders"
        )
    return DataSpec(
        train=train,
        val=val,
        num_classes=len(train.classes),
        in_chans=3,
        description=f"ImageFolder {root}: {len(train):,} train / {len(val):,} val images, {len(train.classes)} classes",
    )


class _SkippingSampler(DistributedSampler):
    """A ``DistributedSampler`` whose next pass leaves out its first ``skip`` indices (a resumed epoch's done part)."""

    skip = 0

    def __iter__(self) -> Any:
        indices = list(super().__iter__())[self.skip :]
        self.skip = 0
        return iter(indices)


class ResumableLoader(DataLoader):
    """The training loader: shuffled per epoch from a seed, sharded over the ranks, and resumable part-way.

    Its sampler is a ``DistributedSampler`` (one replica without a process group), so the order depends on the seed
    and the epoch only: an interrupted run and an uninterrupted one see the same batches. Lightning saves a loader's
    ``state_dict()`` in each checkpoint and hands it back to ``load_state_dict()`` when a fit resumes mid-epoch
    (its stateful-loader protocol); the state is the epoch and the batches already yielded in it, and the resumed
    epoch starts after them without loading them.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, **kwargs: Any) -> None:
        replicas = {} if dist.is_available() and dist.is_initialized() else {"num_replicas": 1, "rank": 0}
        sampler = _SkippingSampler(dataset, shuffle=True, seed=seed, **replicas)
        # drop_last: equal-sized training micro-batches, so the accumulated gradient has a fixed scale.
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=True, **kwargs)
        self._position = (0, 0)  # (epoch, batches yielded in it)
        self._resume: tuple[int, int] | None = None

    def __iter__(self) -> Any:
        # A generator: this body runs at the first batch, after Lightning has set the sampler's epoch.
        sampler = self.sampler
        assert isinstance(sampler, _SkippingSampler)
        epoch = sampler.epoch
        skip = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None
        sampler.skip = skip * (self.batch_size or 1)
        self._position = (epoch, skip)
        for batch in super().__iter__():
            self._position = (epoch, self._position[1] + 1)
            yield batch

    def state_dict(self) -> dict[str, int]:
        epoch, batches = self._position
        return {"epoch": epoch, "batches": batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))


class ImageDataModule(LightningDataModule):
    """The two loaders over a :class:`DataSpec`.

    Training uses a :class:`ResumableLoader` (shuffled from ``seed``, sharded, resumable mid-epoch); Lightning wraps
    the validation loader in a ``DistributedSampler`` under any distributed strategy (sharded, not shuffled).

    The training loader's position also travels in the datamodule's own checkpoint entry: Lightning drops a loader's
    saved state when ``configure_optimizers`` read ``trainer.estimated_stepping_batches`` (Lightning #20550: the
    loader is built before the checkpoint is restored), and the LR schedule here does read it.
    """

    def __init__(self, spec: DataSpec, batch_size: int, num_workers: int, pin_memory: bool, seed: int = 0) -> None:
        super().__init__()
        self.spec = spec
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self._train_loader: ResumableLoader | None = None
        self._train_position: dict[str, int] | None = None  # from a checkpoint, for the next training loader

    def train_dataloader(self) -> DataLoader:
        self._train_loader = ResumableLoader(
            self.spec.train,
            self.batch_size,
            self.seed,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )
        if self._train_position is not None:
            self._train_loader.load_state_dict(self._train_position)
            self._train_position = None
        return self._train_loader

    def state_dict(self) -> dict[str, Any]:
        return {} if self._train_loader is None else {"train_loader": self._train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = state_dict.get("train_loader")
        if position is None:
            return
        if self._train_loader is not None:  # restored after the strategy's setup built the loader (FSDP)
            self._train_loader.load_state_dict(position)
        else:
            self._train_position = position

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.spec.val,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )
