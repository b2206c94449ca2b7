"""The seed's ViT case study as a script that runs: DDP + mixed precision + gradient accumulation + SyncBN + clipping.

Section 7 of the seed document trains ViT-B/16 with DDP, fp16 autocast with a GradScaler, 4-step gradient
accumulation, SyncBN and gradient clipping at 1.0 (AdamW, lr 3e-4, weight decay 0.05, 128 images per GPU, 90 epochs).
Its script does not run as written (no dataset, undefined names) and converts a model that has no BatchNorm to SyncBN.
This one runs the same recipe through lit_accel -- ``AccelDDP`` (DDP, global batch, SyncBN), ``AccelPrecision``
(autocast + dynamic loss scaling), ``LossScaleMonitor`` and ``EfficiencyMonitor`` -- and runs anywhere:

* without a GPU, ``python examples/vit.py`` trains a small ViT on scikit-learn's bundled handwritten digits (1,797 real
  8x8 images upsampled to 16 px, fixed 80/20 split): 96-99% validation accuracy (5 seeds) in 1-2 minutes on 2 CPU
  cores that other jobs were using too;
* with GPUs it trains ViT-B/16 at 224 px on synthetic ImageNet-shaped data (a throughput run) unless ``--data`` names
  ``digits`` or an ImageFolder tree.

Commands::

    # one process (no GPU: the digits ViT; one GPU: ViT-B/16 on synthetic data, add --max-steps 100 for a quick look)
    python examples/vit.py
    # one node, 8 GPUs: Lightning starts the 7 other processes itself
    python examples/vit.py --devices 8
    # the same, started by torchrun
    torchrun --nproc_per_node=8 examples/vit.py --devices 8
    # two nodes of 8 GPUs: run on both nodes, with NODE_RANK=0 on the first and 1 on the second
    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=8 --master_addr=$MASTER_ADDR --master_port=29500 \
        examples/vit.py --devices 8 --num-nodes 2
    # DDP without a GPU: two CPU processes joined by gloo (Lightning-launched, or by torchrun)
    python examples/vit.py --accelerator cpu --devices 2
    # the same, sharded (FSDP2: parameters, gradients and optimizer state split over the processes)
    python examples/vit.py --accelerator cpu --devices 2 --strategy accel_fsdp
    torchrun --nproc_per_node=2 examples/vit.py --accelerator cpu --devices 2
    # the seed's full recipe on real data: 128 per GPU x 8 GPUs x 4 accumulation = 4096 images per optimizer step
    python examples/vit.py --config examples/configs/vit_b16_imagenet.yaml --data /data/imagenet
    # SyncBN doing real work: ResNet-18 has 20 BatchNorm layers (a ViT has none, so --sync-bn changes nothing there);
    # 30 epochs reached 99.2% in ~11 minutes on 2 busy CPU cores: add --epochs 5 for a quicker look
    python examples/vit.py --accelerator cpu --devices 2 --model resnet18 --img-size 32
    # for comparison: Lightning's own DDP strategy in full fp32
    python examples/vit.py --devices 8 --strategy ddp --precision 32-true
    # the same case study as a LightningCLI program, every setting in one YAML file (see examples/vit_cli.py)
    python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml
    # stop after 30 optimizer steps, then continue the same run (its folder, settings and schedule) to step 60
    python examples/vit.py --max-steps 30
    python examples/vit.py --resume last --max-steps 60

Settings come from the flags (timm ``train.py``'s names, or this script's earlier ones), over an optional ``--config``
YAML file (keys are the flags' names), over defaults that depend on the data: the digits preset (``vit_digits``, 16 px,
32 images per optimizer step, 30 epochs, lr 2e-3) or the seed's recipe for ``synthetic`` and ImageFolder data.

Each run gets a folder of its own under ``--output`` (default ``runs/vit``), named ``<date>-<time>-<model>-<img size>``
or ``--experiment``, never reused (``_vit_runs.py``): ``config.yaml`` (the resolved settings, reusable with
``--config``), ``metrics.csv`` (CSVLogger), ``checkpoints/best.ckpt`` and ``checkpoints/last.ckpt``,
``training.png``/``training.json`` (loss, validation accuracy and LR; ``_vit_report.py``), ``efficiency.json`` and
``memory.json`` (the monitors' reports, each with a ``.png`` beside it; ``loss_scale.json`` too under ``16-mixed``) and
``results.json`` (the final table). The console shows one line per epoch. ``--resume`` continues a run exactly in its
folder (a resumed part logs to ``resumed-N/metrics.csv`` there). ``--max-steps`` stops a run early without shortening
its LR schedule, which spans ``--epochs``. Configuration errors (unknown model, missing data, a global batch that does
not divide) end with one ``error:`` line and exit status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import timm
import torch
import torch.nn.functional as F
import yaml
from _vit_data import (
    SYNTHETIC_TRAIN_SAMPLES,
    DataSpec,
    ImageDataModule,
    check_image_folder,
    digits_datasets,
    folder_datasets,
    synthetic_datasets,
)
from _vit_report import TrainingReport
from _vit_runs import CONFIG_NAME, StopAtStep, check_global_batch, create_run_dir, find_checkpoint, run_dir_of
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from rich.console import Console
from rich.table import Table
from timm.optim import param_groups_weight_decay
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import lit_accel
from lit_accel import (
    AccelDDP,
    AccelFSDP,
    AccelPrecision,
    EfficiencyMonitor,
    LossScaleMonitor,
    MemoryMonitor,
    NonFiniteGuard,
)

# A ViT small enough for 8x8 digits on a CPU: timm's ViT-Tiny at width 96, depth 4, 3 heads (~0.45 M parameters), with
# 4x4 patches on the 16x16 upsampled digits, i.e. one token per 2x2 block of original pixels (16 tokens + class token).
# Measured on 2 cores: 2x2 patches (64 tokens) cost 4x more per epoch and needed ~40 epochs, not ~15, to pass 90%.
DIGITS_MODEL = "vit_digits"
DIGITS_MODEL_BASE = "vit_tiny_patch16_224"
DIGITS_MODEL_KWARGS: dict[str, Any] = {"patch_size": 4, "embed_dim": 96, "depth": 4, "num_heads": 3}

# Defaults that depend on the data. ``None`` in the parser means "take it from here".
DIGITS_GLOBAL_BATCH = 32
DIGITS_DEFAULTS: dict[str, Any] = {
    "model": DIGITS_MODEL,
    "img_size": 16,
    "batch_size": None,  # DIGITS_GLOBAL_BATCH // devices
    "accumulate": 1,
    "epochs": 30,
    "lr": 2e-3,
}
# The seed's recipe (section 7): ViT-B/16 at 224 px, 128 images per GPU, 4-step accumulation, AdamW lr 3e-4.
IMAGENET_DEFAULTS: dict[str, Any] = {
    "model": "vit_base_patch16_224",
    "img_size": None,  # the model's own input size (timm's pretrained config)
    "batch_size": 128,
    "accumulate": 4,
    "epochs": 90,
    "lr": 3e-4,
}
SYNTHETIC_EPOCHS = 1  # one pass over 1.28 M synthetic images is a throughput run, not a training run
CPU_DEVICES = 1
WARMUP_FRACTION = 0.05
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "fp8-mixed")
# Strategies whose processes are started by multiprocessing (spawn/fork) train in children and hand only the weights
# and metrics back to this process: its trainer never sees the steps, and the closing validation would start new
# processes. This script therefore runs script-launched strategies (Lightning's "popen" launcher, or torchrun).
_CHILD_PROCESS_STRATEGY_MARKERS = ("spawn", "fork", "notebook")


class UsageError(Exception):
    """A configuration the script cannot run: printed as one ``error:`` line, exit status 2."""


# ----------------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show a default only where there is one: ``None`` means "from the data preset", as each help text says."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The flags, under timm ``train.py``'s names where it has one (this script's earlier names still work)."""
    parser = argparse.ArgumentParser(
        prog="vit.py",
        description="Train a ViT (or any timm model) with lit_accel: DDP, mixed precision, accumulation, SyncBN.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--config", default=None, help="YAML file of settings (flag names as keys); flags override it")

    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default=None,
        help=f"any timm model name, or {DIGITS_MODEL!r} (the small digits ViT); "
        f"default: {DIGITS_MODEL} on digits, {IMAGENET_DEFAULTS['model']} otherwise",
    )
    group.add_argument(
        "--img-size", type=int, default=None, help="input size in pixels; default: 16 on digits, the model's own else"
    )
    group.add_argument(
        "--torchcompile", "--compile", dest="compile", action="store_true", help="compile the model (torch.compile)"
    )
    group.add_argument("--channels-last", action="store_true", help="channels-last memory format (helps conv nets)")

    group = parser.add_argument_group("data")
    group.add_argument(
        "--data",
        "--data-dir",
        dest="data",
        default=None,
        help="'synthetic', 'digits' or a path to an ImageFolder tree with train/ and val/; "
        "default: synthetic with a GPU, digits without",
    )
    group.add_argument(
        "--synthetic-samples", type=int, default=SYNTHETIC_TRAIN_SAMPLES, help="training images of --data synthetic"
    )
    group.add_argument(
        "-j",
        "--workers",
        "--num-workers",
        dest="num_workers",
        type=int,
        default=None,
        help="loader processes per device; default: 0 on digits, else <= 8",
    )

    group = parser.add_argument_group("optimisation (defaults: the seed's recipe, or the digits preset)")
    group.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=None,
        help=f"images per device per micro-batch; default: {DIGITS_GLOBAL_BATCH} / devices on digits, "
        f"{IMAGENET_DEFAULTS['batch_size']} otherwise",
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="images per optimizer step over all devices; sets the accumulation (batch x devices x accumulation)",
    )
    group.add_argument(
        "--grad-accum-steps", "--accumulate", dest="accumulate", type=int, default=None, help="micro-batches per step"
    )
    group.add_argument("--epochs", type=int, default=None, help="default: 30 digits, 1 synthetic, 90 ImageFolder")
    group.add_argument(
        "--max-steps",
        type=int,
        default=-1,
        help="stop after this many optimizer steps (-1: at the end of --epochs); the LR schedule still spans --epochs, "
        "so --resume continues the run exactly",
    )
    group.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate")
    group.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay (not on norms and biases)")
    group.add_argument(
        "--warmup-epochs", type=float, default=None, help="linear warm-up, in epochs, before the cosine decay"
    )
    group.add_argument(
        "--warmup-steps", type=int, default=None, help="the warm-up in optimizer steps instead; default of both: 5%%"
    )
    group.add_argument("--clip-grad", type=float, default=1.0, help="clip the gradient norm (0: off)")

    group = parser.add_argument_group("precision and distribution")
    group.add_argument("--precision", choices=PRECISIONS, default=None, help="default: 16-mixed on GPU, 32-true on CPU")
    group.add_argument("--accelerator", default="auto", help="auto, cpu, gpu, ...")
    group.add_argument(
        "--devices", default=None, help="devices per node: N, a list '0,1' or 'auto'; default: all GPUs, or 1 on CPU"
    )
    group.add_argument("--num-nodes", type=int, default=1, help="number of nodes")
    group.add_argument(
        "--strategy",
        default=None,
        help="accel_ddp (default with several devices), accel_fsdp (sharded: FSDP2), or a Lightning strategy name for "
        "comparison, e.g. ddp (no SyncBN then; the global batch is still honoured)",
    )
    group.add_argument(
        "--sync-bn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="synchronise BatchNorm statistics across devices (AccelDDP; a model without BatchNorm has none to sync)",
    )

    group = parser.add_argument_group("run")
    group.add_argument("--seed", type=int, default=42, help="random seed (the digits split is fixed regardless)")
    group.add_argument(
        "--output",
        "--output-dir",
        dest="output",
        default="runs/vit",
        help="parent folder of the runs: each run gets its own folder in it, never reused",
    )
    group.add_argument(
        "--experiment", default=None, help="the run folder's name; default: <date>-<time>-<model>-<img size>"
    )
    group.add_argument(
        "--resume",
        default=None,
        help="continue a run: a checkpoint, a run folder (its last.ckpt) or 'last' (the run under --output that saved "
        "last); its config.yaml gives the settings, flags override them",
    )
    group.add_argument(
        "--log-interval",
        "--log-every-n-steps",
        dest="log_every_n_steps",
        type=int,
        default=10,
        help="logging interval in optimizer steps",
    )
    group.add_argument(
        "--plan",
        action="store_true",
        help="print every layout's predicted memory per device (lit_accel.plan) for this run and exit",
    )
    group.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="intra-op threads per process on CPU; default: 1 for the digits ViT, else OMP_NUM_THREADS or torch's",
    )
    return parser


# Settings of one invocation, not of the run: a resumed run does not take them from the run's config.yaml.
_PER_INVOCATION = ("config", "resume", "max_steps", "output", "experiment")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line over ``--config`` over a resumed run's ``config.yaml``, then fill the defaults."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    for flags in (("--config",), ("--resume",), ("--output", "--output-dir")):
        pre.add_argument(*flags, dest=flags[0].lstrip("-"), default=None)
    known, _ = pre.parse_known_args(argv)
    keys = _config_keys(parser)
    config = _load_config(known.config, keys) if known.config is not None else {}
    checkpoint, run_dir = None, None
    if known.resume is not None:
        output = Path(known.output or config.get("output") or parser.get_default("output"))
        try:
            checkpoint = find_checkpoint(known.resume, output)
        except ValueError as err:
            raise UsageError(str(err)) from None
        run_dir = run_dir_of(checkpoint)
        if run_dir is not None:  # the run's own settings, below --config and the flags
            saved = _load_config(str(run_dir / CONFIG_NAME), keys)
            parser.set_defaults(**{k: v for k, v in saved.items() if k not in _PER_INVOCATION})
    parser.set_defaults(**config)
    args = parser.parse_args(argv)
    args.resume = None if checkpoint is None else str(checkpoint)
    args.run_dir = None if run_dir is None else str(run_dir)
    return resolve(args)


# timm's flag names and this script's earlier ones, as keys of a config file: the setting each one sets.
_CONFIG_ALIASES = {
    "grad_accum_steps": "accumulate",
    "workers": "num_workers",
    "torchcompile": "compile",
    "data_dir": "data",
    "output_dir": "output",
    "log_interval": "log_every_n_steps",
}


def _config_keys(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every setting's name, and its aliases, as a config key mapped to the setting."""
    return {**{dest: dest for dest in vars(parser.parse_args([]))}, **_CONFIG_ALIASES}


def _load_config(path: str, keys: dict[str, str]) -> dict[str, Any]:
    """A YAML file of settings, keyed by any of their flag names, as ``{setting: value}``."""
    try:
        with open(path) as file:
            config = yaml.safe_load(file) or {}
    except OSError as err:
        raise UsageError(f"--config {path!r}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise UsageError(f"--config {path!r} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(config, dict):
        raise UsageError(f"--config {path!r} must hold a mapping of flag names to values")
    config = {str(key).replace("-", "_"): value for key, value in config.items()}
    unknown = sorted(set(config) - set(keys))
    if unknown:
        raise UsageError(f"--config {path!r}: unknown settings {unknown}; use the flag names, e.g. 'batch_size'")
    return {keys[key]: value for key, value in config.items() if keys[key] != "config"}


def _uses_cuda(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every ``None`` default from the data preset and check what can be checked before training.

    Raises:
        UsageError: for an unknown model, a missing data path or inconsistent batch settings.
    """
    for flag in ("batch_size", "global_batch_size", "accumulate", "epochs", "num_nodes", "img_size", "cpu_threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.warmup_epochs is not None and args.warmup_epochs < 0:
        raise UsageError(f"--warmup-epochs must be 0 or more, got {args.warmup_epochs}")
    cuda = _uses_cuda(args.accelerator)
    if args.data is None:
        args.data = "synthetic" if cuda else "digits"
    if args.data not in ("synthetic", "digits"):
        problem = check_image_folder(args.data)
        if problem is not None:
            raise UsageError(problem)
    if args.devices is None:
        args.devices = "auto" if cuda else CPU_DEVICES
    args.devices = _parse_devices(args.devices)
    args.world_size = _device_count(args.devices, cuda) * args.num_nodes
    if args.world_size < 1:
        raise UsageError(f"--devices {args.devices!r} selects no device; pass a positive number, a list or 'auto'")

    preset = DIGITS_DEFAULTS if args.data == "digits" else IMAGENET_DEFAULTS
    for key in ("model", "img_size", "batch_size", "lr"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.batch_size is None:  # digits: the same 32-image optimizer steps on any number of processes
        args.batch_size = max(1, DIGITS_GLOBAL_BATCH // args.world_size)
    if args.epochs is None:
        args.epochs = SYNTHETIC_EPOCHS if args.data == "synthetic" else preset["epochs"]
    _check_model_name(args.model)
    if args.img_size is None:
        args.img_size = _default_img_size(args.model)
    if args.precision is None:
        args.precision = "16-mixed" if cuda else "32-true"
    if args.cpu_threads is None and not cuda and args.model == DIGITS_MODEL and "OMP_NUM_THREADS" not in os.environ:
        # The digits ViT multiplies 17x96 matrices: a second thread gains ~30% on an idle 2-core machine, but its
        # OpenMP barriers stall whenever the other core is busy (measured 4-6x slower with other work running).
        args.cpu_threads = 1
    if args.num_workers is None:
        local = max(1, args.world_size // args.num_nodes)
        args.num_workers = 0 if args.data == "digits" else min(8, max(1, (os.cpu_count() or 1) // local))

    if args.warmup_epochs is not None and args.warmup_steps is not None:
        raise UsageError("--warmup-epochs and --warmup-steps both set the warm-up; give only one of them")
    if args.global_batch_size is not None:
        # lit_accel's own plan (what AccelDDP computes at fit start), checked before any process is launched.
        try:
            accumulate = check_global_batch(args.global_batch_size, args.batch_size, args.world_size)
        except ValueError as err:
            raise UsageError(str(err)) from None
        if args.accumulate is not None and args.accumulate != accumulate:
            raise UsageError(
                f"--accumulate {args.accumulate} contradicts --global-batch-size {args.global_batch_size} = "
                f"{args.batch_size} per device x {args.world_size} devices x {accumulate}; give only one of them"
            )
        args.accumulate = accumulate
    elif args.accumulate is None:
        args.accumulate = preset["accumulate"]
    if args.strategy is None:
        args.strategy = "accel_ddp" if args.world_size > 1 else "auto"
    if any(marker in args.strategy for marker in _CHILD_PROCESS_STRATEGY_MARKERS):
        raise UsageError(
            f"--strategy {args.strategy!r} trains in multiprocessing children, which return only the weights to this "
            "script; use a script-launched strategy (accel_ddp, ddp) or start the processes with torchrun"
        )
    return args


def _check_model_name(name: str) -> None:
    if name == DIGITS_MODEL or timm.is_model(name.split(".")[0]):
        return
    close = difflib.get_close_matches(name, [DIGITS_MODEL, *timm.list_models()], n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see timm.list_models() for the names"
    raise UsageError(f"--model {name!r} is not a timm model nor {DIGITS_MODEL!r}{hint}")


def _default_img_size(name: str) -> int:
    cfg = timm.get_pretrained_cfg(name.split(".")[0]) if name != DIGITS_MODEL else None
    return int(cfg.input_size[-1]) if cfg is not None and cfg.input_size else 224


def _parse_devices(devices: Any) -> int | str | list[int]:
    if isinstance(devices, int | list):
        return devices
    text = str(devices).strip()
    if text == "auto":
        return text
    try:
        if "," in text:
            return [int(index) for index in text.split(",") if index.strip()]
        return int(text)
    except ValueError:
        raise UsageError(f"--devices {devices!r} must be a number, a list like '0,1' or 'auto'") from None


def _device_count(devices: int | str | list[int], cuda: bool) -> int:
    if isinstance(devices, list):
        return len(devices)
    if devices == "auto" or devices == -1:
        return max(1, torch.cuda.device_count()) if cuda else 1
    return int(devices)


# ----------------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------------
def build_model(name: str, num_classes: int, in_chans: int, img_size: int) -> nn.Module:
    """A timm model with a fresh head; ``img_size`` goes to the models that take it (ViTs), conv nets adapt anyway."""
    base, extra = (DIGITS_MODEL_BASE, DIGITS_MODEL_KWARGS) if name == DIGITS_MODEL else (name, {})
    kwargs = {"pretrained": False, "num_classes": num_classes, "in_chans": in_chans, **extra}
    try:
        return timm.create_model(base, img_size=img_size, **kwargs)
    except TypeError as err:
        if "img_size" not in str(err):
            raise
        return timm.create_model(base, **kwargs)


def count_batchnorms(model: nn.Module) -> int:
    return sum(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


class ImageClassifier(pl.LightningModule):
    """Cross-entropy training of any image model, AdamW with linear warm-up and cosine decay, top-1 accuracy.

    Args:
        net: the model.
        num_classes: number of classes.
        lr: peak learning rate.
        weight_decay: AdamW weight decay, applied to weights only (timm's ``param_groups_weight_decay`` exempts
            norms, biases and position embeddings, as in the DeiT/timm recipes).
        warmup_steps: linear warm-up in optimizer steps; ``None`` (and no ``warmup_epochs``) takes 5% of the run.
        channels_last: move the input batches to channels-last memory format.
        input_shape: ``(channels, height, width)`` of one image: Lightning's model summary runs one such (zero) image
            through the model to show the layers' FLOPs and input/output sizes.
        warmup_epochs: the warm-up in epochs instead of ``warmup_steps`` (timm's ``--warmup-epochs``).

    The schedule spans the planned run (``trainer.estimated_stepping_batches``: ``max_epochs``, or ``max_steps``
    when the Trainer has one); ``vit.py`` stops early with a callback instead, so the schedule stays that of the run.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        lr: float,
        weight_decay: float,
        warmup_steps: int | None,
        channels_last: bool = False,
        input_shape: tuple[int, int, int] | None = None,
        warmup_epochs: float | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.net = net
        if input_shape is not None:
            self.example_input_array = torch.zeros(1, *input_shape)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")  # top-1 over all images
        self.last_val_step = -1
        self.synced_batchnorms = 0
        self.resolved_warmup_steps: int | None = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.net(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        # The progress bar reads the value only when it refreshes; Lightning divides the loss by the accumulation.
        self.log("train/loss", loss, prog_bar=True)
        # The epoch's mean over all ranks, for the per-epoch line: accumulated on device, reduced once at epoch end.
        self.log("train/loss_epoch", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        # torchmetrics reduces its counts over all ranks; the loss needs sync_dist.
        self.log("val/acc", self.val_acc, prog_bar=True)
        self.log("val/loss", F.cross_entropy(logits, labels), sync_dist=True)

    def on_train_start(self) -> None:
        # What the strategy really trains with: AccelDDP swaps every BatchNorm for a SyncBatchNorm while fitting.
        self.synced_batchnorms = sum("SyncBatchNorm" in type(module).__name__ for module in self.net.modules())

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.last_val_step = self.trainer.global_step

    def configure_optimizers(self) -> dict[str, Any]:
        groups = param_groups_weight_decay(self.net, self.hparams.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = self.hparams.warmup_steps
        if warmup is None and self.hparams.get("warmup_epochs") is not None:
            # estimated_stepping_batches has loaded the train dataloader: its batches per epoch are known
            per_epoch = math.ceil(self.trainer.num_training_batches / self.trainer.accumulate_grad_batches)
            warmup = round(self.hparams.warmup_epochs * per_epoch)
        warmup = round(WARMUP_FRACTION * total) if warmup is None else warmup
        self.resolved_warmup_steps = warmup

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# ----------------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------------
def build_data(args: argparse.Namespace) -> DataSpec:
    if args.data == "digits":
        return digits_datasets(args.img_size)
    if args.data == "synthetic":
        return synthetic_datasets(args.img_size, args.synthetic_samples)
    # The model's normalisation and interpolation come from timm's pretrained config (ImageNet's when it has none).
    cfg = timm.get_pretrained_cfg(args.model.split(".")[0]) if args.model != DIGITS_MODEL else None
    return folder_datasets(args.data, cfg.to_dict() if cfg is not None else {}, args.img_size)


def build_strategy(args: argparse.Namespace, num_batchnorms: int) -> Any:
    if args.strategy in ("accel_ddp", "accel_fsdp"):
        # With a global batch, the strategy derives the accumulation itself; giving it the micro-batch size lets it do
        # so at setup, before configure_optimizers reads trainer.estimated_stepping_batches for the LR schedule.
        cls = AccelDDP if args.strategy == "accel_ddp" else AccelFSDP
        return cls(
            # a model without BatchNorm has nothing to synchronise (and AccelDDP would say so): pass it only with some
            sync_batchnorm=args.sync_bn and num_batchnorms > 0,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.batch_size if args.global_batch_size is not None else None,
            compile=args.compile,  # each block compiled before DDP wraps / FSDP shards it
        )
    if args.sync_bn and num_batchnorms and args.world_size > 1:
        echo(
            f"note: --strategy {args.strategy} is not AccelDDP, so the {num_batchnorms} BatchNorm layers are not "
            "synchronised (use --strategy accel_ddp, or Lightning's Trainer(sync_batchnorm=True) on GPUs)"
        )
    return args.strategy


def echo(message: str) -> None:
    if rank_zero_only.rank == 0:
        Console(highlight=False).print(message, soft_wrap=True)


def train(args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(args.seed, workers=True, verbose=False)
    if args.cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.cpu_threads)  # also for the processes Lightning launches
        torch.set_num_threads(args.cpu_threads)
    if _uses_cuda(args.accelerator):
        torch.set_float32_matmul_precision("high")  # TF32 matmuls for the fp32 parts

    try:
        spec = build_data(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    net = build_model(args.model, spec.num_classes, spec.in_chans, args.img_size)
    num_params = sum(p.numel() for p in net.parameters())
    num_batchnorms = count_batchnorms(net)
    if args.channels_last:
        net = net.to(memory_format=torch.channels_last)
    if args.compile and args.strategy not in ("accel_ddp", "accel_fsdp"):
        net.compile()  # Lightning's strategies: the whole net (lit_accel's compile the blocks, in the strategy)
    module = ImageClassifier(
        net,
        spec.num_classes,
        args.lr,
        args.weight_decay,
        args.warmup_steps,
        args.channels_last,
        input_shape=(spec.in_chans, args.img_size, args.img_size),
        warmup_epochs=args.warmup_epochs,
    )
    cuda = _uses_cuda(args.accelerator)
    datamodule = ImageDataModule(spec, args.batch_size, args.num_workers, pin_memory=cuda, seed=args.seed)
    if args.plan:
        print_plan(args, module, datamodule)
        return {}

    # A resumed run continues in its own folder; a new one gets a folder of its own (never another run's).
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        run_dir = create_run_dir(Path(args.output), args.experiment, args.model, args.img_size)
    # fp16 gets dynamic loss scaling (skipped steps counted), bf16/FP8 autocast through AccelPrecision; full precision
    # is Lightning's own plugin. Without a loss scaler, NonFiniteGuard keeps inf/NaN gradients out of the weights.
    plugins = [] if args.precision == "32-true" else [AccelPrecision(args.precision)]
    efficiency = EfficiencyMonitor(report_path=run_dir / "efficiency.json", print_summary=False)
    callbacks = build_callbacks(args, run_dir, efficiency)
    strategy = build_strategy(args, num_batchnorms)
    try:
        trainer = pl.Trainer(
            accelerator=args.accelerator,
            devices=args.devices,
            num_nodes=args.num_nodes,
            strategy=strategy,
            plugins=plugins,
            accumulate_grad_batches=args.accumulate,
            gradient_clip_val=args.clip_grad or None,
            max_epochs=args.epochs,
            max_steps=-1,  # --max-steps stops the run (StopAtStep), leaving the schedule that of --epochs
            callbacks=callbacks,
            logger=build_logger(run_dir, resumed=args.resume is not None),
            log_every_n_steps=args.log_every_n_steps,
            default_root_dir=run_dir,
            benchmark=cuda,
        )
    except (ValueError, MisconfigurationException) as err:
        raise UsageError(" ".join(str(err).split())) from None

    if trainer.is_global_zero:
        # Create the CSV writer first: it warns about a log folder that is not empty, and config.yaml is not a log.
        _ = trainer.logger.experiment
        save_config(args, run_dir / CONFIG_NAME)
    echo_header(args, num_params, num_batchnorms, spec.description, run_dir)

    if args.resume:  # continuing in the run's own folder: its checkpoints are expected there
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=args.resume, weights_only=True)
    fit_seconds = time.perf_counter() - start
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
    if module.last_val_step != trainer.global_step or "val/acc" not in metrics:
        # The fit ended without validating its last weights (a resumed run that had nothing left to train).
        metrics.update(trainer.validate(module, datamodule=datamodule, verbose=False)[0])

    results = collect_results(args, trainer, module, efficiency, metrics, fit_seconds, num_params)
    results["output_dir"] = str(run_dir)
    if trainer.is_global_zero:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        print_table(results)
    return results


def print_plan(args: argparse.Namespace, module: pl.LightningModule, datamodule: pl.LightningDataModule) -> None:
    """``--plan``: every layout's predicted memory per device for this run (one loaded batch, no training)."""
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    device = "cuda" if _uses_cuda(args.accelerator) else "cpu"
    memory = _device_memory(args, device)
    print(lit_accel.plan(module, batch, world_size=args.world_size, device=device, precision=args.precision,
                         global_batch_size=args.global_batch_size, memory_per_device=memory))  # fmt: skip


def _device_memory(args: argparse.Namespace, device: str) -> float | None:
    """One device's memory, for --plan's fit verdicts: the first GPU's, else this host's RAM over its processes."""
    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, args.world_size // args.num_nodes)


def build_callbacks(args: argparse.Namespace, run_dir: Path, efficiency: EfficiencyMonitor) -> list[Any]:
    callbacks = [
        RichProgressBar(),
        LearningRateMonitor(logging_interval="step"),
        # best.ckpt (highest val/acc) and last.ckpt, saved at each validation; --resume continues from either. At the
        # validation, not at the epoch's end: a run stopped mid-epoch must not look like a finished epoch on resume.
        ModelCheckpoint(
            run_dir / "checkpoints",
            filename="best",
            monitor="val/acc",
            mode="max",
            save_top_k=1,
            save_last=True,
            save_on_train_epoch_end=False,
            enable_version_counter=False,
        ),
        efficiency,
        MemoryMonitor(report_path=run_dir / "memory.json", print_summary=False),
        TrainingReport(run_dir),  # a line per epoch; training.png and training.json at the end
        StopAtStep(args.max_steps if args.max_steps > 0 else None),
    ]
    if args.precision == "16-mixed":  # the only precision with a loss scale to watch
        callbacks.append(LossScaleMonitor(report_path=run_dir / "loss_scale.json"))
    else:
        callbacks.append(NonFiniteGuard())
    return callbacks


def build_logger(run_dir: Path, resumed: bool) -> CSVLogger:
    """``metrics.csv`` in the run folder; a resumed run's part in ``resumed-N/`` (the CSV logger would replace it)."""
    if not resumed:
        return CSVLogger(run_dir, name="", version="")
    number = 1 + sum(1 for path in run_dir.glob("resumed-*") if path.is_dir())
    return CSVLogger(run_dir, name="", version=f"resumed-{number}")


def echo_header(args: argparse.Namespace, num_params: int, num_batchnorms: int, data: str, run_dir: Path) -> None:
    syncbn = (
        f"{num_batchnorms} BatchNorm layers, synchronised across {args.world_size} devices"
        if num_batchnorms and args.sync_bn and args.strategy in ("accel_ddp", "accel_fsdp") and args.world_size > 1
        else f"{num_batchnorms} BatchNorm layers" + (": --sync-bn has nothing to do" if not num_batchnorms else "")
    )
    global_batch = args.batch_size * args.world_size * args.accumulate
    resumed = f" | resumed from {args.resume}" if args.resume else ""
    echo(
        f"[bold]{args.model}[/bold] ({num_params / 1e6:.2f} M parameters, {syncbn}) | {data}\n"
        f"global batch {global_batch} = {args.batch_size} per device x {args.world_size} devices x "
        f"{args.accumulate} accumulation | {args.precision} | strategy {args.strategy} | lit_accel "
        f"{lit_accel.__version__}\nrun folder {run_dir}{resumed}"
    )


def save_config(args: argparse.Namespace, path: Path) -> None:
    """Save the resolved settings, loadable again with ``--config`` (the timm habit)."""
    skip = ("config", "world_size", "resume", "run_dir")  # this invocation's, not the run's settings
    config = {key: value for key, value in vars(args).items() if key not in skip}
    if config["global_batch_size"] is not None:
        config["accumulate"] = None  # derived from the global batch and the number of devices
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def collect_results(
    args: argparse.Namespace,
    trainer: pl.Trainer,
    module: ImageClassifier,
    efficiency: Any,
    metrics: dict[str, float],
    fit_seconds: float,
    num_params: int,
) -> dict[str, Any]:
    summary = dict(getattr(efficiency, "summary", None) or {})
    precision = trainer.precision_plugin
    return {
        "model": args.model,
        "parameters": num_params,
        "batchnorm_layers": count_batchnorms(module.net),
        "sync_batchnorm_layers": module.synced_batchnorms,
        "data": args.data,
        "device": trainer.strategy.root_device.type,
        "world_size": trainer.world_size,
        "global_batch_size": args.batch_size * trainer.world_size * trainer.accumulate_grad_batches,
        "accumulate": trainer.accumulate_grad_batches,
        "precision": args.precision,
        "strategy": args.strategy,
        "epochs": trainer.current_epoch,
        "optimizer_steps": trainer.global_step,
        "warmup_steps": module.resolved_warmup_steps,
        "val_acc": metrics.get("val/acc"),
        "val_loss": metrics.get("val/loss"),
        "train_loss": metrics.get("train/loss"),
        "samples_per_sec": summary.get("samples_per_sec"),
        "step_time_ms": summary.get("step_time_ms"),
        "data_wait_frac": summary.get("data_wait_frac"),
        "tflops_per_device": summary.get("tflops_per_device"),
        "mfu": summary.get("mfu"),
        "comm_time_frac": summary.get("comm_time_frac"),
        "comm_exposed_frac": summary.get("comm_exposed_frac"),
        "skipped_steps": getattr(precision, "skipped_steps", 0),
        "loss_scale": getattr(precision, "loss_scale", None),
        "fit_seconds": fit_seconds,
        "output_dir": None,  # the run folder, set by train()
    }


def print_table(results: dict[str, Any]) -> None:
    def fmt(value: Any, spec: str, unit: str = "", unknown: str = "n/a") -> str:
        return unknown if value is None else format(value, spec) + unit

    def fmt_flops(tflops: float | None) -> str:  # "13.1 GFLOP/s" on a CPU, not "0.01 TFLOP/s"
        if tflops is None:
            return "n/a"
        return f"{tflops:.3g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.3g} GFLOP/s"

    no_mfu = "no MFU on CPU" if results["device"] == "cpu" else "n/a (unknown peak)"  # a CPU has no datasheet peak
    table = Table(title="ViT case study: results", show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("model", f"{results['model']} ({results['parameters'] / 1e6:.2f} M params)"),
        ("BatchNorm layers (synchronised)", f"{results['batchnorm_layers']} ({results['sync_batchnorm_layers']})"),
        ("data", results["data"]),
        ("devices x accumulation", f"{results['world_size']} x {results['accumulate']}"),
        ("global batch", str(results["global_batch_size"])),
        ("precision / strategy", f"{results['precision']} / {results['strategy']}"),
        ("optimizer steps (epochs)", f"{results['optimizer_steps']} ({results['epochs']})"),
        ("val accuracy (top-1)", fmt(results["val_acc"], ".2%")),
        ("val loss", fmt(results["val_loss"], ".4f")),
        ("samples/s (all devices)", fmt(results["samples_per_sec"], ",.1f")),
        ("optimizer step time", fmt(results["step_time_ms"], ",.1f", " ms")),
        ("data wait (share of step)", fmt(results["data_wait_frac"], ".1%")),
        ("FLOP/s per device", fmt_flops(results["tflops_per_device"])),
        ("MFU", fmt(results["mfu"], ".1%", unknown=no_mfu)),
        ("gradient comm in flight (share of step)", fmt(results["comm_time_frac"], ".1%")),
        ("gradient comm exposed (share of step)", fmt(results["comm_exposed_frac"], ".1%")),
        ("skipped optimizer steps (inf/NaN)", str(results["skipped_steps"])),
        ("loss scale", fmt(results["loss_scale"], ".0f") if results["precision"] == "16-mixed" else "none (no fp16)"),
        ("fit time", fmt(results["fit_seconds"], ".1f", " s")),
        ("outputs", results["output_dir"]),
    ]
    for name, value in rows:
        table.add_row(name, value)
    Console(width=max(100, Console().width)).print(table)


# ----------------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------------
def _is_lit_accel_config_error(err: BaseException) -> bool:
    """True for the ``ValueError``/``TypeError`` that lit_accel documents for bad settings (raised in its own code)."""
    if not isinstance(err, ValueError | TypeError):
        return False
    package = str(Path(lit_accel.__file__).parent)
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(package)


def main(argv: list[str] | None = None) -> int:
    try:
        train(parse_args(argv))
    except UsageError as err:
        if rank_zero_only.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as err:
        if not _is_lit_accel_config_error(err):
            raise
        if rank_zero_only.rank == 0:
            print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
