"""TileMIL (encoder + head): per-bag embedding in every mode, frozen baseline, weights loading."""

from __future__ import annotations

import pytest
import torch

from dpgs.config.schema import ModelConfig
from dpgs.modeling import build_model
from dpgs.models import build_head
from dpgs.models.tilemil import TileMIL, build_encoder, load_encoder_weights
from dpgs.train.batching import pack_batch, pad_batch
from tests._biglayers_reference import dense_resnet


def tile_model(big_stages: int = 1, freeze: bool = False, head: str = "abmil", chunk: int = 256,
               max_elements: int = 1 << 16) -> TileMIL:
    torch.manual_seed(0)
    encoder = build_encoder("resnet18", big_stages=big_stages, max_elements=max_elements)
    params = {"dropout": 0.0} if head == "abmil" else {}
    model = TileMIL(encoder, build_head(head, encoder.feature_dim, 2, **params), freeze, chunk)
    return model.double()


def bags(lengths=(2, 1, 3), size=40, seed=1):
    """Tiles of 40 px: the last stage is 2 x 2, so a one-tile bag still has several values per channel."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, size, size, generator=g, dtype=torch.float64) for n in lengths]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_and_padded_batches_equal_the_sum_of_per_bag_losses():
    """BatchNorm statistics are per bag, so a batch's gradient is the mean of the per-bag gradients."""
    xs, y = bags(), torch.tensor([1, 0, 1])
    model = tile_model()
    per_bag = []
    for x, label in zip(xs, y, strict=True):
        per_bag.append(model.loss(x, label)["loss"])
    torch.stack(per_bag).mean().backward()
    reference = grads(model)
    model.zero_grad()
    packed = model.loss_packed(*pack_batch(xs), y)
    packed["loss"].backward()
    torch.testing.assert_close(packed["per_bag"], torch.stack(per_bag).detach(), rtol=1e-10, atol=1e-12)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, reference[name], rtol=1e-9, atol=1e-12, msg=name)
    model.zero_grad()
    x, mask = pad_batch(xs)
    padded = model.loss(x, y, mask=mask)
    padded["loss"].backward()
    torch.testing.assert_close(padded["per_bag"], torch.stack(per_bag).detach(), rtol=1e-10, atol=1e-12)
    for name, g in grads(model).items():
        torch.testing.assert_close(g, reference[name], rtol=1e-9, atol=1e-12, msg=name)


def test_big_layer_encoder_equals_the_dense_encoder_through_the_head():
    xs, y = bags(), torch.tensor([0, 1, 1])
    big, dense = tile_model(big_stages=2, max_elements=20000), tile_model(big_stages=-1)
    dense.load_state_dict(big.state_dict())
    out_big = big.loss_packed(*pack_batch(xs), y)
    out_dense = dense.loss_packed(*pack_batch(xs), y)
    out_big["loss"].backward()
    out_dense["loss"].backward()
    torch.testing.assert_close(out_big["logits"], out_dense["logits"], rtol=1e-10, atol=1e-12)
    reference = grads(dense)
    for name, g in grads(big).items():
        torch.testing.assert_close(g, reference[name], rtol=1e-8, atol=1e-11, msg=name)
    for (name, a), b in zip(big.state_dict().items(), dense.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)  # running statistics too


def test_eval_embedding_in_chunks_equals_one_pass():
    x = bags((5,))[0]
    model = tile_model(chunk=2).eval()
    with torch.no_grad():
        chunked = model.embed(x)
        one_pass = model.encoder(x)
        scores = model.instance_scores(x)
    torch.testing.assert_close(chunked, one_pass, rtol=1e-12, atol=1e-12)
    assert scores.shape == (5,) and torch.isfinite(scores).all()


def test_frozen_encoder_gets_no_gradient_and_keeps_its_statistics():
    model = tile_model(freeze=True).train()
    assert not model.encoder.training and model.head.training
    before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    out = model.loss_packed(*pack_batch(bags()), torch.tensor([1, 0, 1]))
    out["loss"].backward()
    assert all(p.grad is None for p in model.encoder.parameters())
    assert all(p.grad is not None for p in model.head.parameters() if p.requires_grad)
    for key, value in model.encoder.state_dict().items():
        assert torch.equal(value, before[key]), key  # BatchNorm running stats unchanged (eval mode)


def test_build_model_from_config():
    cfg = ModelConfig(name="meanmil", encoder="resnet18", big_stages=0, freeze_encoder=True)
    model = build_model(cfg, None, 3)
    assert isinstance(model, TileMIL) and model.head.in_dim == 512
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("head.") for n in trainable)
    with pytest.raises(ValueError, match="feature dimension"):
        build_model(ModelConfig(name="abmil"), None, 2)


def test_torchvision_weights_load_and_mismatches_are_named(tmp_path):
    reference = dense_resnet("resnet18", num_classes=1000, dtype=torch.float32)
    path = tmp_path / "resnet18.pth"
    torch.save(reference.state_dict(), path)  # torchvision format, with fc.weight/fc.bias
    encoder = build_encoder("resnet18", big_stages=1)
    load_encoder_weights(encoder, path)
    for key, value in encoder.state_dict().items():
        assert torch.equal(value, reference.state_dict()[key]), key
    wrong = tmp_path / "resnet50.pth"
    torch.save(dense_resnet("resnet50", dtype=torch.float32).state_dict(), wrong)
    with pytest.raises(ValueError, match=r"resnet50\.pth does not fit the encoder"):
        load_encoder_weights(build_encoder("resnet18"), wrong)
    with pytest.raises(ValueError, match="missing.pth not found"):
        load_encoder_weights(encoder, tmp_path / "missing.pth")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="garbage.pth is not a readable state_dict"):
        load_encoder_weights(encoder, garbage)


def amp_errors(big_stages: int, xs, y) -> tuple[float, float]:
    """Relative error of the logits and of the gradient of bf16-autocast vs float32 training."""
    exact, amp = tile_model(big_stages).float(), tile_model(big_stages).float()
    amp.amp = True
    out_exact, out_amp = (m.loss_packed(*pack_batch(xs), y) for m in (exact, amp))
    assert out_amp["logits"].dtype == torch.float32
    out_exact["loss"].backward()
    out_amp["loss"].backward()
    g_exact = torch.cat([p.grad.flatten() for p in exact.parameters()])
    g_amp = torch.cat([p.grad.flatten() for p in amp.parameters()])
    assert not torch.equal(g_amp, g_exact)  # autocast really ran in bfloat16
    logits = (out_amp["logits"] - out_exact["logits"]).detach().norm() / out_exact["logits"].detach().norm()
    return float(logits), float((g_amp - g_exact).norm() / g_exact.norm())


def test_bf16_autocast_of_the_big_encoder_is_as_accurate_as_the_dense_one():
    """bf16 is coarse (a random-init ResNet's gradient moves by tens of percent under plain torch autocast
    too), so the big-layer encoder is held to the error of the dense encoder under the same autocast."""
    xs, y = [x.float() for x in bags((4, 3), size=64)], torch.tensor([1, 0])
    big_logits, big_grad = amp_errors(1, xs, y)
    dense_logits, dense_grad = amp_errors(-1, xs, y)
    assert big_logits < max(2 * dense_logits, 2e-2)
    assert big_grad < max(1.5 * dense_grad, 0.1), (big_grad, dense_grad)
