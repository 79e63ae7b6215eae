"""Feature-bag data: manifests, layouts, readers, validation, splits, lazy cached bags, prefetch, demo.

See ``docs/data.md`` for the formats and ``docs/architecture.md`` ("Feature bags") for the contract.
"""

from dpgs.data.cache import ByteLRUCache
from dpgs.data.dataset import Bag, BagDataset
from dpgs.data.demo import write_demo_data
from dpgs.data.errors import DataValidationError
from dpgs.data.feature_experiment import ExperimentData, build_splits, load_feature_experiment
from dpgs.data.layout import FeatureLayout, resolve_layout
from dpgs.data.manifest import Manifest, SlideRecord, load_manifest
from dpgs.data.prefetch import Prefetcher
from dpgs.data.readers import BagInfo, BagReadError, bag_info, read_bag
from dpgs.data.splits import Split, clam_splits, kfold_splits, manifest_split
from dpgs.data.validate import check_inputs, validate_inputs

__all__ = [
    "Bag",
    "BagDataset",
    "BagInfo",
    "BagReadError",
    "ByteLRUCache",
    "DataValidationError",
    "ExperimentData",
    "FeatureLayout",
    "Manifest",
    "Prefetcher",
    "SlideRecord",
    "Split",
    "bag_info",
    "build_splits",
    "check_inputs",
    "clam_splits",
    "kfold_splits",
    "load_feature_experiment",
    "load_manifest",
    "manifest_split",
    "read_bag",
    "resolve_layout",
    "validate_inputs",
    "write_demo_data",
]
