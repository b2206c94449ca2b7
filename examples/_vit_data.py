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
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = [
    "DIGITS_SPLIT_SEED",
    "DataSpec",
    "ImageDataModule",
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


class ImageDataModule(LightningDataModule):
    """The two loaders over a :class:`DataSpec`.

    Lightning wraps both loaders in a ``DistributedSampler`` under any distributed strategy, shuffling the training
    set each epoch and sharding the validation set without shuffling.
    """

    def __init__(self, spec: DataSpec, batch_size: int, num_workers: int, pin_memory: bool) -> None:
        super().__init__()
        self.spec = spec
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            drop_last=shuffle,  # equal-sized training micro-batches: the accumulated gradient has a fixed scale
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.spec.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.spec.val, shuffle=False)
