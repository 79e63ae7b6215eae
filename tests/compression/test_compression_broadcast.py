"""DeltaBroadcaster (master -> workers), layouts and the keep-ratio warm-up."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpgs.compression import (
    DeltaBroadcaster,
    KeepRatioSchedule,
    ParamLayout,
    PayloadError,
    TopKCompressor,
    VersionMismatchError,
    apply_payload,
    encode_snapshot,
    read_header,
)
from dpgs.compression.wire import KIND_DELTA, KIND_SNAPSHOT
from dpgs.distributed.flat import flat_params


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_worker_plus_residual_equals_master_after_random_updates(dtype):
    torch.manual_seed(0)
    n = 3000
    params = torch.randn(n)
    broadcaster = DeltaBroadcaster(value_dtype=dtype, dense_sync_every=25, exact_max_numel=1000)
    workers = [torch.zeros(n), torch.zeros(n)]
    versions: list[int | None] = [None, None]
    for step in range(60):
        if step % 3 == 0:
            params += torch.randn(n) * 10.0 ** float(torch.randint(-5, 1, (1,)))  # dense jitter
        else:
            idx = torch.randint(0, n, (50,))
            params[idx] += torch.randn(50) * 100  # sparse big jumps
        payload, meta = broadcaster.step(params, 0.02)
        versions = [apply_payload(w, payload, v) for w, v in zip(workers, versions, strict=True)]
        assert meta.payload_bytes == len(payload) and meta.version == versions[0] == broadcaster.version
        for worker in workers:
            assert torch.equal(worker, broadcaster.held)  # bit for bit, no drift
            residual = params.double() - broadcaster.held.double()  # exact in float64
            assert torch.equal(worker.double() + residual, params.double())
        assert meta.snapshot == (step % 25 == 0)


def test_residual_is_flushed_when_params_stop_changing():
    torch.manual_seed(0)
    params = torch.randn(1000)
    broadcaster = DeltaBroadcaster(value_dtype="fp32", dense_sync_every=None)
    worker = torch.zeros(1000)
    version = apply_payload(worker, broadcaster.step(params, 0.05)[0], None)
    params += torch.randn(1000)
    for _ in range(20):  # 50 entries per step: 1000 entries in 20 steps
        version = apply_payload(worker, broadcaster.step(params, 0.05)[0], version)
    assert torch.equal(worker, params)
    assert torch.equal(broadcaster.held, params)


def test_version_mismatch_then_snapshot_recovers():
    torch.manual_seed(0)
    params = torch.randn(500)
    broadcaster = DeltaBroadcaster(dense_sync_every=None)
    on_time, late = torch.zeros(500), torch.zeros(500)
    first = broadcaster.step(params, 0.1)[0]
    v_on_time = apply_payload(on_time, first, None)
    v_late = apply_payload(late, first, None)
    params += torch.randn(500)
    missed = broadcaster.step(params, 0.1)[0]
    v_on_time = apply_payload(on_time, missed, v_on_time)
    params += torch.randn(500)
    current = broadcaster.step(params, 0.1)[0]
    v_on_time = apply_payload(on_time, current, v_on_time)
    before = late.clone()
    with pytest.raises(VersionMismatchError, match="holds version 1, the delta payload produces version 3"):
        apply_payload(late, current, v_late)
    assert torch.equal(late, before)  # untouched on error
    snapshot = encode_snapshot(broadcaster.held, broadcaster.version)  # what in-sync workers hold
    assert read_header(snapshot).kind == KIND_SNAPSHOT
    v_late = apply_payload(late, snapshot, v_late)
    assert v_late == v_on_time == 3 and torch.equal(late, on_time)
    joiner = torch.zeros(500)
    assert apply_payload(joiner, snapshot, None) == 3 and torch.equal(joiner, on_time)


def test_apply_payload_rejects_wrong_kind_numel_and_first_delta():
    broadcaster = DeltaBroadcaster()
    broadcaster.step(torch.randn(100), 0.1)
    delta, _ = broadcaster.step(torch.randn(100), 0.1)
    assert read_header(delta).kind == KIND_DELTA
    with pytest.raises(VersionMismatchError):
        apply_payload(torch.zeros(100), delta, None)
    with pytest.raises(PayloadError, match="numel mismatch"):
        apply_payload(torch.zeros(99), delta, 1)
    gradient = TopKCompressor().compress(torch.randn(100), 0.1)
    with pytest.raises(PayloadError, match="a gradient payload where a delta or snapshot payload is"):
        apply_payload(torch.zeros(100), gradient, 0)


def test_dense_sync_every():
    broadcaster = DeltaBroadcaster(dense_sync_every=3)
    kinds = [broadcaster.step(torch.randn(50), 0.1)[1].snapshot for _ in range(7)]
    assert kinds == [True, False, False, True, False, False, True]


def test_state_dict_round_trip_continues_identically():
    params = torch.randn(300)
    a = DeltaBroadcaster(dense_sync_every=5)
    for _ in range(3):
        params += torch.randn(300)
        a.step(params, 0.05)
    b = DeltaBroadcaster(dense_sync_every=5)
    b.load_state_dict(a.state_dict())
    for _ in range(4):  # across the next periodic snapshot
        params += torch.randn(300)
        assert a.step(params, 0.05)[0] == b.step(params, 0.05)[0]
    assert torch.equal(a.held, b.held) and a.version == b.version


def test_broadcaster_with_layout_sends_dense_tensors_every_step():
    layout = ParamLayout.from_shapes([("w", (40, 50)), ("b", (40,)), ("w2", (3, 40))], dense_names=["b"])
    torch.manual_seed(0)
    params = torch.randn(layout.numel)
    broadcaster = DeltaBroadcaster(value_dtype="fp32", layout=layout, dense_sync_every=None)
    worker = torch.zeros(layout.numel)
    version = apply_payload(worker, broadcaster.step(params, 0.01)[0], None)
    params += torch.randn(layout.numel)
    version = apply_payload(worker, broadcaster.step(params, 0.01)[0], version)
    bias = layout.unflatten(worker)["b"]
    assert torch.equal(bias, layout.unflatten(params)["b"])


def test_layout_from_module_matches_flat_params_order():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    layout = ParamLayout.from_module(model, dense_min_numel=10)
    flat = flat_params(model)
    assert layout.numel == flat.numel()
    views = layout.unflatten(flat)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert list(views) == list(trainable) == layout.names
    for name, param in trainable.items():
        assert torch.equal(views[name], param.detach())
    assert [s.name for s in layout if s.dense] == ["0.bias", "1.weight", "2.weight", "2.bias"]
    np.testing.assert_array_equal(layout.dense_ranges(), [[108, 18]])  # adjacent tensors merged


def test_layout_dense_ranges_merge_and_validation():
    shapes = [("a", (5,)), ("b", (3,)), ("c", (100,)), ("d", (2,))]
    layout = ParamLayout.from_shapes(shapes, dense_min_numel=10)
    np.testing.assert_array_equal(layout.dense_ranges(), [[0, 8], [108, 2]])
    with pytest.raises(ValueError, match="flat vector has 3 elements, the layout has 110"):
        layout.unflatten(torch.zeros(3))
    with pytest.raises(ValueError, match="the layout has 110"):
        TopKCompressor(layout=layout).compress(torch.zeros(3), 0.1)


def test_keep_ratio_schedule():
    schedule = KeepRatioSchedule(0.001)
    assert [schedule(e) for e in range(6)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    assert [KeepRatioSchedule(0.01)(e) for e in range(5)] == [0.25, 0.0625, 0.015625, 0.01, 0.01]
    custom = KeepRatioSchedule.exponential(0.01, epochs=2, start=0.5, factor=0.5)
    assert [custom(e) for e in range(3)] == [0.5, 0.25, 0.01]
    with pytest.raises(ValueError, match=r"warmup\[1\] must be in"):
        KeepRatioSchedule(0.01, warmup=[0.5, 2.0])
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        schedule(-1)
