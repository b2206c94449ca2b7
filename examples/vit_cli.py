"""The ViT case study of ``examples/vit.py`` as a LightningCLI program: one YAML file holds every setting.

``vit.py`` resolves data-dependent defaults with its own flags; this entry point hands the same model, data and
lit_accel objects to Lightning's ``LightningCLI``, so the strategy (``AccelDDP`` with its global batch and SyncBN),
the precision plugin (``AccelPrecision``, with a nested ``DynamicGradScaler`` for fp16), the ``NonFiniteGuard`` and
the monitors are written as ``class_path``/``init_args`` in YAML, overridden by ``--section.key=value`` flags, and
saved, resolved, as ``config.yaml`` next to the run's logs. A misspelled key ends the run before any process starts,
naming the key.

Commands::

    # the digits ViT on one CPU process (examples/configs/vit_digits_cli.yaml): >= 90% validation accuracy
    python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml
    # two CPU processes: the same 32-image optimizer steps, 16 per device, so accumulation 1 instead of 2
    python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml --trainer.devices=2
    # one nested setting changed; fp16 with lit_accel's scaler (on a GPU: CPU fp16 is emulated and slow)
    python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml --trainer.accelerator=gpu \\
        --trainer.plugins=lit_accel.AccelPrecision --trainer.plugins.precision=16-mixed \\
        --trainer.plugins.scaler=lit_accel.DynamicGradScaler --trainer.plugins.scaler.hysteresis=2
    # the resolved configuration, without training
    python examples/vit_cli.py fit --config examples/configs/vit_digits_cli.yaml --print_config

Everything goes to ``--output_dir`` (default ``runs/vit_cli``): ``config.yaml``, ``metrics.csv``, ``checkpoints/``,
``efficiency.json`` (the ``EfficiencyMonitor``, configured under the YAML's ``efficiency:`` key) and ``training.png``
with its data ``training.json`` (``vit.py``'s ``TrainingReport``, under ``report:``, which also prints a line per
epoch). ``--trainer.max_steps`` validates the weights it stops at inside fit (``StopAtStep``, under ``stop:``). A
``global_batch_size`` that the data's batch size and the devices cannot make is reported before any process starts.

Give the strategy in the YAML or as ``--trainer.strategy=accel_ddp``; ``--trainer.strategy=lit_accel.AccelDDP``
alone is read as a strategy *name* by Lightning (Lightning #19682), and repeated after a config that sets the strategy
it starts over from the class defaults: override single arguments with ``--trainer.strategy.global_batch_size=64``
instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from _vit_data import SYNTHETIC_TRAIN_SAMPLES, ImageDataModule
from _vit_report import TrainingReport
from _vit_runs import StopAtStep
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from vit import DIGITS_MODEL, ImageClassifier, build_data, build_model, echo

import lit_accel  # noqa: F401 - registers the strategy names (accel_ddp, accel_fsdp, ...) for --trainer.strategy
from lit_accel import EfficiencyMonitor
from lit_accel.layout.batch_plan import make_batch_plan


class ViTClassifier(ImageClassifier):
    """``vit.py``'s classifier, built from a model name so that LightningCLI can configure it.

    Args:
        model_name: any timm model name, or ``"vit_digits"`` (the small digits ViT).
        num_classes, in_chans: set from the data (linked by the CLI).
        img_size: input size in pixels (linked from ``data.img_size``).
        lr, weight_decay, warmup_steps, channels_last, warmup_epochs: as for ``ImageClassifier``.
        compile: compile the model with ``torch.compile``.
    """

    def __init__(
        self,
        model_name: str = DIGITS_MODEL,
        num_classes: int = 10,
        in_chans: int = 1,
        img_size: int = 16,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        warmup_steps: int | None = None,
        channels_last: bool = False,
        compile: bool = False,
        warmup_epochs: float | None = None,
    ) -> None:
        net = build_model(model_name, num_classes, in_chans, img_size)
        if channels_last:
            net = net.to(memory_format=torch.channels_last)
        if compile:
            net.compile()
        shape = (in_chans, img_size, img_size)
        args = (net, num_classes, lr, weight_decay, warmup_steps, channels_last)
        super().__init__(*args, input_shape=shape, warmup_epochs=warmup_epochs)


class ViTData(ImageDataModule):
    """``vit.py``'s data: ``"digits"``, ``"synthetic"`` or an ImageFolder tree with ``train/`` and ``val/``.

    Args:
        data: which data.
        img_size: input size in pixels.
        batch_size: images per device per micro-batch (AccelDDP's ``micro_batch_size`` must match it).
        num_workers: loader processes per device.
        synthetic_samples: training images of ``"synthetic"``.
        model_name: the model, whose timm config gives an ImageFolder's normalisation (linked by the CLI).
        pin_memory: pin host memory (helps with GPUs).
        seed: the training order's seed (an interrupted run resumes in the same order).
    """

    def __init__(
        self,
        data: str = "digits",
        img_size: int = 16,
        batch_size: int = 16,
        num_workers: int = 0,
        synthetic_samples: int = SYNTHETIC_TRAIN_SAMPLES,
        model_name: str = DIGITS_MODEL,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        spec = build_data(
            argparse.Namespace(data=data, img_size=img_size, synthetic_samples=synthetic_samples, model=model_name)
        )
        super().__init__(spec, batch_size, num_workers, pin_memory, seed)
        self.num_classes, self.in_chans = spec.num_classes, spec.in_chans


class ViTCLI(LightningCLI):
    """LightningCLI with the case study's links: one output directory, data shape into the model, the monitor."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--output_dir", type=str, default="runs/vit_cli", help="logs, checkpoints, reports")
        parser.add_argument("--cpu_threads", type=int | None, default=None, help="intra-op threads per process")
        parser.add_lightning_class_args(EfficiencyMonitor, "efficiency")
        parser.add_lightning_class_args(TrainingReport, "report")  # a line per epoch; training.png at the end
        parser.add_lightning_class_args(StopAtStep, "stop")  # validates the weights that --trainer.max_steps stops at
        parser.link_arguments("output_dir", "trainer.default_root_dir")
        parser.link_arguments("output_dir", "trainer.logger.init_args.save_dir")  # when the logger is a class
        parser.link_arguments("output_dir", "efficiency.report_path", compute_fn=_efficiency_report)
        parser.link_arguments("output_dir", "report.output_dir")
        parser.link_arguments("data.img_size", "model.img_size")
        parser.link_arguments("model.model_name", "data.model_name")
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.in_chans", "model.in_chans", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.cpu_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(config.cpu_threads)  # also for the processes Lightning launches
            torch.set_num_threads(config.cpu_threads)

    def before_fit(self) -> None:
        """Check the global batch before any process starts: one ``error:`` line and exit status 2, not one per rank."""
        trainer, strategy = self.trainer, self.trainer.strategy
        global_batch = getattr(strategy, "global_batch_size", None)
        if global_batch is None:
            return
        world = trainer.num_devices * trainer.num_nodes
        try:
            make_batch_plan(global_batch, self.datamodule.batch_size, world, owner=type(strategy).__name__)
        except ValueError as err:
            if rank_zero_only.rank == 0:
                print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
            sys.exit(2)

    def after_fit(self) -> None:
        trainer, module = self.trainer, self.model
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        if module.last_val_step != trainer.global_step or "val/acc" not in metrics:
            # Training stopped between two validations (e.g. --trainer.max_steps): validate the final weights.
            metrics.update(trainer.validate(module, datamodule=self.datamodule, verbose=False)[0])
        if rank_zero_only.rank == 0:
            echo(f"validation accuracy {metrics['val/acc']:.2%} after {trainer.global_step} optimizer steps")


def _efficiency_report(output_dir: str) -> str:
    return str(Path(output_dir) / "efficiency.json")


def main() -> None:
    ViTCLI(ViTClassifier, ViTData, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
