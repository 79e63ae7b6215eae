"""TileMIL training steps on CUDA (run on a GPU machine: `pytest -m gpu tests/test_tilemil_gpu.py`)."""

import pytest
import torch

from dpgs.models import build_head
from dpgs.models.tilemil import TileMIL, build_encoder
from dpgs.train.batching import pack_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def model(big_stages: int, device: str, freeze: bool = False) -> TileMIL:
    torch.manual_seed(0)
    encoder = build_encoder("resnet18", big_stages=big_stages, max_elements=1 << 18)
    head = build_head("abmil", encoder.feature_dim, 2, dropout=0.0)
    return TileMIL(encoder, head, freeze_encoder=freeze).double().to(device)


def step(m: TileMIL, xs, y):
    """Loss, logits and every gradient of one packed step over host-resident tiles."""
    out = m.loss_packed(*pack_batch(xs), y.to(m.encoder.device))
    out["loss"].backward()
    grads = {n: p.grad.detach().cpu() for n, p in m.named_parameters() if p.grad is not None}
    return out["logits"].detach().cpu(), grads, {k: v.cpu() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("big_stages", [-1, 1, 4])
def test_cuda_step_equals_the_cpu_step(big_stages):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 3, 64, 64, generator=g, dtype=torch.float64) for n in (5, 2, 9)]
    y = torch.tensor([1, 0, 1])
    cpu_logits, cpu_grads, cpu_state = step(model(big_stages, "cpu"), xs, y)
    gpu_logits, gpu_grads, gpu_state = step(model(big_stages, "cuda"), xs, y)
    torch.testing.assert_close(gpu_logits, cpu_logits, rtol=1e-9, atol=1e-11)
    assert gpu_grads.keys() == cpu_grads.keys()
    for name, g_cpu in cpu_grads.items():
        torch.testing.assert_close(gpu_grads[name], g_cpu, rtol=1e-8, atol=1e-10, msg=name)
    for name, v in cpu_state.items():
        torch.testing.assert_close(gpu_state[name], v, rtol=1e-9, atol=1e-11, msg=name)


def test_frozen_and_bf16_training_run_on_cuda():
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 3, 64, 64, generator=g) for n in (4, 3)]
    frozen = model(1, "cuda", freeze=True).float()
    frozen.loss_packed(*pack_batch(xs), torch.tensor([0, 1], device="cuda"))["loss"].backward()
    assert all(p.grad is None for p in frozen.encoder.parameters())
    amp = model(1, "cuda").float()
    amp.amp = True
    out = amp.loss_packed(*pack_batch(xs), torch.tensor([0, 1], device="cuda"))
    out["loss"].backward()
    assert out["logits"].dtype == torch.float32 and torch.isfinite(out["loss"])
    assert all(torch.isfinite(p.grad).all() for p in amp.parameters() if p.grad is not None)
