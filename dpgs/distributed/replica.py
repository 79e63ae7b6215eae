"""A model as a DPGS step sees it: flat trainable parameters, floating-point buffers, an optimizer.

The master holds one with an optimizer; workers hold one with a replica of the master's optimizer where
they take the master's steps themselves (``downlink=gradients``), else without: given the same averaged
gradient, the same clip factor and learning rate, :meth:`Replica.step` takes exactly the master's step
(one function, :func:`dpgs.train.optim.optimizer_step`; the same thread count on every rank keeps it bit
for bit).

With ``dpgs.compression.second_moment=frozen`` every rank turns its Adam into a
:class:`dpgs.train.frozen_adam.FrozenAdam` at the same step (:meth:`Replica.freeze_second_moment`), and
the gradients it is given from then on are preconditioned by :meth:`Replica.preconditioner`.
"""

from __future__ import annotations

import torch

from dpgs.config.schema import TrainConfig
from dpgs.distributed.flat import flat_params, float_buffers, load_flat_params, trainable
from dpgs.distributed.messages import ReplicaState
from dpgs.train.frozen_adam import FrozenAdam, freeze
from dpgs.train.optim import build_optimizer, optimizer_step
from dpgs.train.optimizers import Optimizer


class Replica:
    """``model`` (trained in place), its optimizer when it steps (see :meth:`restart`) and its version."""

    def __init__(self, model: torch.nn.Module, train_cfg: TrainConfig):
        self.model = model
        self.train_cfg = train_cfg
        self.params = trainable(model)
        self.numel = sum(p.numel() for p in self.params)
        self.buffer_list = float_buffers(model)
        self.n_buffers = sum(b.numel() for b in self.buffer_list)
        self.optimizer: Optimizer | None = None
        self._denominators: tuple[Optimizer, torch.Tensor] | None = None  # (frozen optimizer, d)
        self._gradient: torch.Tensor | None = None
        self.version = 0

    def flat_params(self) -> torch.Tensor:
        """Trainable parameters as one float32 CPU vector."""
        return flat_params(self.model)

    def load_params(self, flat: torch.Tensor) -> None:
        load_flat_params(self.model, flat)

    def flat_buffers(self) -> torch.Tensor | None:
        """Floating-point buffers (BatchNorm running statistics) as one float64 CPU vector, or None."""
        if not self.buffer_list:
            return None
        return torch.cat([b.detach().reshape(-1).double().cpu() for b in self.buffer_list])

    def load_buffers(self, flat: torch.Tensor | None) -> None:
        if flat is None:
            return
        if flat.numel() != self.n_buffers:
            raise ValueError(f"{flat.numel()} buffer values for a model with {self.n_buffers}")
        offset = 0
        with torch.no_grad():
            for b in self.buffer_list:
                b.copy_(flat[offset : offset + b.numel()].view_as(b).to(b.dtype))
                offset += b.numel()

    def gradient_buffer(self) -> torch.Tensor:
        """The float32 CPU vector of ``numel`` in which this rank forms each step's gradient (the sum of the
        workers' messages, then their mean in place), handed to :meth:`step`. The same vector every step,
        holding the last step's values: a fresh ``4 * numel`` bytes would pay its page faults every step
        (about 20 ms for ResNet-18's 46 MB on the development VM, against 1.4 ms to zero this one)."""
        if self._gradient is None:
            self._gradient = torch.empty(self.numel, dtype=torch.float32)
        return self._gradient

    def step(self, grad: torch.Tensor, lr: float, clip: float) -> None:
        """One optimizer step on the flat float32 gradient ``grad`` (already the mini-batch mean)."""
        if self.optimizer is None:
            raise RuntimeError("this replica has no optimizer (the master sends it weights)")
        offset = 0
        for p in self.params:
            p.grad = grad[offset : offset + p.numel()].view_as(p).to(device=p.device, dtype=p.dtype)
            offset += p.numel()
        optimizer_step(self.optimizer, self.params, lr, clip)

    def state(self, params: torch.Tensor) -> ReplicaState:
        """What an in-sync worker holds: flat parameters ``params`` (the master's own, or a delta
        broadcast's ``held``) with this replica's buffers, optimizer state and version."""
        buffers = self.flat_buffers()
        return ReplicaState(
            version=self.version,
            params=params,
            buffers=None if buffers is None else buffers.float(),
            optimizer=None if self.optimizer is None else self.optimizer.state_dict(),
        )

    def load_state(self, state: ReplicaState) -> None:
        self.load_params(state.params)
        self.load_buffers(state.buffers)
        if self.optimizer is not None:
            if state.optimizer is None:
                raise ValueError("resynchronisation without optimizer state for a replica optimizer")
            self.load_optimizer(state.optimizer)
        self.version = state.version

    def load_optimizer(self, state_dict: dict) -> None:
        """Restore an optimizer state (a checkpoint's, a resynchronisation's), frozen or not: a FrozenAdam's
        state makes this replica's optimizer a FrozenAdam, and an Adam's a fresh one of the config."""
        if FrozenAdam.holds(state_dict):
            self.optimizer = FrozenAdam.empty(self.params, state_dict["param_groups"])
        elif isinstance(self.optimizer, FrozenAdam):
            self.optimizer = build_optimizer(self.params, self.train_cfg)
        self.optimizer.load_state_dict(state_dict)

    @property
    def frozen(self) -> bool:
        """Whether this replica's optimizer is Adam with its second moment frozen."""
        return isinstance(self.optimizer, FrozenAdam)

    def freeze_second_moment(self, floor: float) -> None:
        """Turn the Adam optimizer into a FrozenAdam (``floor``: see :func:`dpgs.train.frozen_adam.freeze`);
        nothing changes when it already is one."""
        if not self.frozen:
            self.optimizer = freeze(self.optimizer, floor)

    def preconditioner(self) -> torch.Tensor:
        """The frozen denominators ``d`` of the flat parameters (a gradient sum ``g`` goes up as ``g / d``),
        as one float32 CPU vector (kept: they do not change while frozen)."""
        if not self.frozen:
            raise RuntimeError("this replica's second moment is not frozen")
        if self._denominators is None or self._denominators[0] is not self.optimizer:
            self._denominators = (self.optimizer, self.optimizer.denominators(self.params).float().cpu())
        return self._denominators[1]

    def restart(self, model_state: dict, with_optimizer: bool) -> None:
        """A new fold: the fold's initial weights, a fresh optimizer (``with_optimizer``) or none,
        version 0."""
        self.model.load_state_dict(model_state)
        self.optimizer = build_optimizer(self.params, self.train_cfg) if with_optimizer else None
        self.version = 0
