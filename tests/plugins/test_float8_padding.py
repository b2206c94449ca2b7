"""FP8 rows padded for torch._scaled_mm: a ViT's 197 tokens at a batch of 3, emulated on CPU with the GPU's shapes.

On a GPU, ``torch._scaled_mm`` refuses an FP8 GEMM whose inner dimension or second operand is not a multiple of 16;
the weight-gradient GEMM's inner dimension is the input's rows (batch x tokens). A dispatch spy records the shapes of
every FP8 matmul (the ``Float8TrainingTensor`` operands torchao hands to ``_scaled_mm``) and applies that rule, so a
CPU run shows what a GPU would refuse.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lit_accel.plugins._float8_padding import RowPadding, rows_to_pad
from lit_accel.plugins.float8 import Float8Conversion

_MATMULS = {"aten::mm", "aten::addmm"}


@pytest.fixture
def float8() -> Any:
    return pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'torchao>=0.10')")


class _ScaledMMRule(TorchDispatchMode):
    """Records every FP8 matmul's operand shapes that CUDA's ``_scaled_mm`` would refuse (its multiple-of-16 rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fp8_matmuls = 0
        self.refused: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _MATMULS and type(args[-1]).__name__ == "Float8TrainingTensor":
            a, b = args[-2], args[-1]
            self.fp8_matmuls += 1
            if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
                self.refused.append((tuple(a.shape), tuple(b.shape)))
        return func(*args, **(kwargs or {}))


def _vit(seed: int = 0) -> nn.Module:
    import timm

    torch.manual_seed(seed)
    # 56 px in 4 px patches: 196 patches + the class token = 197 tokens, as ViT-B/16 at 224 px.
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=56, patch_size=4, depth=1, embed_dim=32, num_heads=2,
        num_classes=16,
    )  # fmt: skip


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("rows", "pad"), [(0, 0), (1, 15), (16, 0), (591, 1), (592, 0), (25216, 0)])
def test_rows_to_pad(rows, pad):
    assert rows_to_pad(rows) == pad


def test_vit_197_tokens_batch_3_runs_only_aligned_fp8_matmuls_and_matches_unpadded(float8):
    x = torch.randn(3, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([1, 5, 9])

    # torchao alone (no padding): the weight-gradient GEMMs get 3 x 197 = 591 rows, which _scaled_mm refuses.
    reference = float8.convert_to_float8_training(_vit(), config=float8.Float8LinearConfig(emulate=True))
    with _ScaledMMRule() as unpadded:
        ref_loss, ref_grads = _step(reference, x, y)
    assert unpadded.refused and any(a[1] == 591 for a, _ in unpadded.refused), unpadded.refused

    conversion = Float8Conversion()  # emulated on CPU, padded as on a GPU
    model = conversion.apply(_vit(), device="cpu")
    assert conversion.report.emulated and len(conversion.report.converted) == 5  # qkv, proj, fc1, fc2, head
    with _ScaledMMRule() as padded:
        loss, grads = _step(model, x, y)
    assert padded.fp8_matmuls == unpadded.fp8_matmuls == 15  # 5 layers x (output, input grad, weight grad)
    assert padded.refused == []
    # Zero rows change neither the FP8 scales (an amax) nor the gradients; the outputs are the unpadded rows.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_aligned_rows_are_not_copied_and_revert_removes_the_hooks(float8):
    conversion = Float8Conversion()
    model = conversion.apply(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), device="cpu")
    seen: list[torch.Size] = []
    model[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))  # runs before the padding
    x = torch.randn(4, 8, 32)  # 32 rows: aligned
    out = model(x)
    assert out.shape == (4, 8, 32) and seen == [x.shape]
    x_odd = torch.randn(3, 5, 32, requires_grad=True)  # 15 rows
    out = model(x_odd)
    assert out.shape == (3, 5, 32)
    out.sum().backward()
    assert x_odd.grad.shape == x_odd.shape

    original = conversion.revert(model)
    assert [type(m) for m in original] == [nn.Linear, nn.GELU, nn.Linear]
    assert len(original[0]._forward_pre_hooks) == 1  # the user's hook stays; ours is gone
    assert len(original[0]._forward_hooks) == 0 and len(original[2]._forward_pre_hooks) == 0


def test_torchao_pad_inner_dim_config_gets_no_row_padding(float8):
    conversion = Float8Conversion(config=float8.Float8LinearConfig(pad_inner_dim=True))
    model = conversion.apply(nn.Sequential(nn.Linear(32, 64)), device="cpu")
    assert len(model[0]._forward_pre_hooks) == 0
    with _ScaledMMRule() as rule:
        model(torch.randn(3, 32, requires_grad=True)).sum().backward()
    assert rule.fp8_matmuls == 3  # torchao pads inside its matmuls, after the spy's view: its shapes are unpadded


def test_row_padding_on_a_plain_linear_is_exact():
    torch.manual_seed(0)
    layer, twin = nn.Linear(8, 4), nn.Linear(8, 4)
    twin.load_state_dict(layer.state_dict())
    padding = RowPadding()
    padding.install([layer])
    assert len(layer._forward_pre_hooks) == len(layer._forward_hooks) == 1
    x = torch.randn(2, 7, 8)
    torch.testing.assert_close(layer(x), twin(x), rtol=0, atol=0)
    padding.remove()
    assert not layer._forward_pre_hooks and not layer._forward_hooks
