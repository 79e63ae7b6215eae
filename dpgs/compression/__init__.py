"""DMGC compression: top-k codec with error feedback, validated wire format, delta broadcaster.

Worker -> master::

    comp = TopKCompressor(keep_ratio=0.01)
    payload = comp.compress(flat_grad)          # bytes; comp.last_stats has the accounting
    grad = decompress(payload)                  # master: dense float32 CPU tensor

Master -> workers::

    broadcaster = DeltaBroadcaster(keep_ratio=0.01, dense_sync_every=100)
    payload, meta = broadcaster.step(master_flat_params)
    version = apply_payload(worker_flat_params, payload, version)   # worker, in place

See ``docs/compression.md``.
"""

from dpgs.compression.broadcast import (
    BroadcastMeta,
    DeltaBroadcaster,
    VersionMismatchError,
    apply_payload,
    encode_snapshot,
)
from dpgs.compression.dtypes import VALUE_DTYPES, ValueDtype
from dpgs.compression.layout import ParamLayout, ParamSpec
from dpgs.compression.selection import Selection, select_topk
from dpgs.compression.topk import CompressionStats, TopKCompressor
from dpgs.compression.warmup import DGC_WARMUP, KeepRatioSchedule
from dpgs.compression.wire import (
    DEFAULT_MAX_NUMEL,
    FORMAT_VERSION,
    HEADER_SIZE,
    KIND_DELTA,
    KIND_GRADIENT,
    KIND_SNAPSHOT,
    MAGIC,
    DecodedPayload,
    PayloadError,
    PayloadHeader,
    decode,
    decompress,
    read_header,
)

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "DGC_WARMUP",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "KIND_DELTA",
    "KIND_GRADIENT",
    "KIND_SNAPSHOT",
    "MAGIC",
    "VALUE_DTYPES",
    "BroadcastMeta",
    "CompressionStats",
    "DecodedPayload",
    "DeltaBroadcaster",
    "KeepRatioSchedule",
    "ParamLayout",
    "ParamSpec",
    "PayloadError",
    "PayloadHeader",
    "Selection",
    "TopKCompressor",
    "ValueDtype",
    "VersionMismatchError",
    "apply_payload",
    "decode",
    "decompress",
    "encode_snapshot",
    "read_header",
    "select_topk",
]
