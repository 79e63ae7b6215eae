"""The bag worker: a model replica that computes its bags' gradients itself (one process, CPU or GPU)."""

from __future__ import annotations

import torch

from dpgs.distributed.flat import flat_grads
from dpgs.distributed.messages import StepPlan
from dpgs.modeling import input_to
from dpgs.train.steps import batch_loss
from dpgs.workers.base import BagGradients, Worker


class BagWorker(Worker):
    """Runs each micro-batch of its bags in one packed forward/backward (per bag for heads whose
    pooling is not segment-wise) and back-propagates the sum of the per-bag losses."""

    def build_model(self, model_spec) -> torch.nn.Module:
        return model_spec.build().to(self.device)

    def bag_gradients(self, indices: list[int], bags: list, step: StepPlan) -> BagGradients:
        seed = self.seed * 1_000_003 + step.index * 8191 + indices[0]
        torch.random.default_generator.manual_seed(seed)  # CPU generator only: no lazy CUDA seeding
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        self.model.zero_grad(set_to_none=True)
        features = [input_to(self.model, b.features, self.device) for b in bags]
        labels = torch.tensor([b.label for b in bags], device=self.device)
        out = batch_loss(self.model, features, labels, "packed", self.class_weights)
        out["per_bag"].sum().backward()
        return BagGradients(
            flat_grads(self.model),
            out["per_bag"].detach().cpu().tolist(),
            sum(int(f.shape[0]) for f in features),
        )
