"""A worker's share of a shared GPU, on CPU: where no cap applies, the error that names the share, and the
peak device memory in the epoch's metrics (the CUDA side: tests/distributed/test_dpgs_gpu.py)."""

from __future__ import annotations

import torch

from dpgs.distributed.dpgs_engine import epoch_metrics
from dpgs.distributed.gpu_share import GpuShare, cap_to_share, peak_bytes
from dpgs.distributed.messages import MasterStep, WorkerStep
from dpgs.distributed.rank_group import ChunkReports


def test_no_cap_and_no_peak_on_cpu():
    assert cap_to_share(0, torch.device("cpu")) is None
    assert peak_bytes(torch.device("cpu")) == 0


def test_the_error_of_a_worker_beyond_its_share_names_the_share_and_the_keys():
    share = GpuShare(worker=1, fraction=0.25, total_bytes=80 << 30)
    assert share.cap_bytes == 20 << 30
    err = share.exceeded(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text"))
    text = str(err)
    assert text.startswith("worker 1 ran out of its share of the GPU "
                           "(cuda memory cap 0.25 x 80.0 GiB = 20.00 GiB")
    assert "dpgs.gpus_per_worker=0.25" in text
    assert text.endswith("CUDA said: CUDA out of memory. Tried to allocate 2.00 GiB")


def _worker_step(index: int, worker: int, peak: int) -> WorkerStep:
    return WorkerStep(index=index, worker=worker, n_bags=1, instances=10, read_wait_seconds=0.0,
                      compute_seconds=0.1, encode_seconds=0.0, exchange_seconds=0.0, apply_seconds=0.0,
                      up_bytes=100, down_bytes=100, peak_device_bytes=peak)


def _master_step(index: int) -> MasterStep:
    return MasterStep(index=index, n_bags=2, loss_sum=1.0, grad_norm=1.0, wait_seconds=0.0,
                      decode_seconds=0.0, optimizer_seconds=0.0, encode_seconds=0.0, up_bytes=200,
                      down_bytes=200, dense_bytes=800, step_seconds=0.2)


def test_epoch_metrics_report_the_largest_worker_peak_only_where_measured():
    gpu = ChunkReports(master=[_master_step(0), _master_step(1)],
                       workers=[_worker_step(0, 0, 3 << 20), _worker_step(0, 1, 5 << 20),
                                _worker_step(1, 0, 4 << 20), _worker_step(1, 1, 2 << 20)])
    assert epoch_metrics(gpu)["worker_peak_device_mib"] == 5.0
    cpu = ChunkReports(master=[_master_step(0)], workers=[_worker_step(0, 0, 0), _worker_step(0, 1, 0)])
    assert "worker_peak_device_mib" not in epoch_metrics(cpu)
