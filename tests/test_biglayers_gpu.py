"""CUDA staging checks (run on a GPU machine: `pytest -m gpu tests/test_biglayers_gpu.py`)."""

import pytest
import torch
from _biglayers_reference import dense_resnet

from dpgs.biglayers import resnet18

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(overlap: bool, x: torch.Tensor, max_elements: int):
    ref = dense_resnet("resnet18", num_classes=3, dtype=torch.float64)
    model = resnet18(big_stages=4, max_elements=max_elements, num_classes=3, device="cuda",
                     dtype=torch.float64, overlap=overlap)
    model.load_state_dict(ref.state_dict())
    y = model(x)
    y.square().sum().backward()
    grads = torch.cat([p.grad.flatten().cpu() for p in model.parameters()])
    return y.cpu(), grads, model, ref


def test_double_buffered_equals_synchronous_and_dense():
    torch.manual_seed(0)
    x = torch.randn(3, 3, 67, 53, dtype=torch.float64)
    y1, g1, _, ref = _run(True, x, 20000)
    y2, g2, _, _ = _run(False, x, 20000)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    r = ref(x)
    torch.testing.assert_close(y1, r, rtol=1e-9, atol=1e-9)


def test_peak_gpu_memory_is_flat_as_the_image_grows():
    peaks = []
    for side in (512, 1024, 2048):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = resnet18(big_stages=4, max_elements=1 << 20, num_classes=0, device="cuda")
        model(torch.randn(1, 3, side, side)).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
        assert model.memory_stats()["peak_tensor_elements"] <= 1 << 20
    # 16x more pixels, nearly the same device memory (parameters, gradients and a few strips)
    assert peaks[-1] < 1.5 * peaks[0], peaks
