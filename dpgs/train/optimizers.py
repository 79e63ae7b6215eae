"""dpgs's optimizers: Adam, AdamW and SGD with momentum over one parameter group, stepped by the fused
kernels that ``torch.optim``'s ``fused=True`` runs (``torch._fused_adam_``, ``torch._fused_adamw_``,
``torch._fused_sgd_``: one pass over every tensor of a device and dtype), in ``torch.optim``'s state-dict
format.

Why not ``torch.optim`` itself: its first use in a process (building an optimizer, ``step``,
``zero_grad``, ``state_dict``) imports ``torch._dynamo`` to exempt itself from compilation, 1.4-1.8 s of
CPU and about 70 MB of memory on the development VM. The driver, the DPGS master and every worker paid it
at the start of every run, and dpgs never compiles an optimizer step (the demo's whole DPGS command went
from 37.2 s to 29.2 s on 2 cores: docs/benchmarks.md). The kernels are ``torch.optim``'s, so a step is
bit for bit a ``torch.optim`` step with ``fused=True``, and a ``torch.optim`` state dict (a checkpoint
written before dpgs had its own optimizers) loads and continues bit for bit (tests/train/test_optimizers.py).

Per parameter ``theta`` with gradient ``g`` and weight decay ``wd``, at step ``t = 1, 2, ...``:

* Adam (Kingma & Ba 2015; ``g <- g + wd theta``, L2 decay coupled) and AdamW (Loshchilov & Hutter 2019;
  ``theta <- theta (1 - lr wd)`` instead)::

      m <- beta1 m + (1 - beta1) g            v <- beta2 v + (1 - beta2) g^2
      theta <- theta - lr (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)

* SGD with momentum ``mu`` (PyTorch's form, no dampening): ``g <- g + wd theta``; the buffer ``b <- g`` at
  the first step, then ``b <- mu b + g``; ``theta <- theta - lr b`` (``mu = 0``: no buffer).

Parameters without a gradient at a step are left as they are, their state too. The kernels run on CPU and
CUDA tensors of floating-point dtypes (the devices dpgs trains on).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch


class Optimizer(ABC):
    """One parameter group, ``param_groups[0]``: its tensors under ``"params"`` and its hyperparameters (the
    learning rate is set before every step: ``dpgs.train.optim.optimizer_step``), and ``state``, each
    stepped parameter's tensors. Subclasses define :meth:`step`."""

    def __init__(self, params: Iterable[torch.Tensor], hyperparameters: dict):
        params = list(params)
        if not params:
            raise ValueError("an optimizer needs at least one parameter")
        self.param_groups: list[dict] = [{**hyperparameters, "params": params}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @property
    def params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    @abstractmethod
    def step(self) -> None:
        """One update of every parameter that has a gradient (``p.grad``), at ``param_groups[0]["lr"]``."""

    def zero_grad(self) -> None:
        """Release every gradient (``p.grad = None``)."""
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """``{"state": {i: {name: tensor}}, "param_groups": [{..., "params": [0, ..., n - 1]}]}``: parameter
        ``i`` of the group by its position, ``torch.optim``'s format. The tensors are this optimizer's own
        (not copies), as ``torch.optim`` gives them."""
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        state = {i: dict(self.state[p]) for i, p in enumerate(self.params) if p in self.state}
        return {"state": state, "param_groups": [{**hyper, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take the hyperparameters and the per-parameter state of ``state_dict`` (this class's or a
        ``torch.optim`` optimizer's of the same kind, for the same parameters in the same order). Tensors are
        copied to their parameter's device, floating-point ones to its dtype; ``step`` stays float32."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"the optimizer state holds {[len(g['params']) for g in groups]} parameters per group; this "
                f"optimizer has one group of {len(self.params)}"
            )
        saved = groups[0]
        known = self.param_groups[0].keys() - {"params"}
        position = {index: i for i, index in enumerate(saved["params"])}
        state = {}
        for index, tensors in state_dict["state"].items():
            p = self.params[position[index]]
            state[p] = {
                name: value.to(device=p.device, dtype=torch.float32 if name == "step" else p.dtype, copy=True)
                for name, value in tensors.items()
            }
        self.param_groups[0].update({k: saved[k] for k in known if k in saved})
        self.state = state

    def _with_grads(self) -> list[torch.Tensor]:
        """The parameters that have a gradient this step, in order."""
        return [p for p in self.params if p.grad is not None]


def by_device_and_dtype(columns: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
    """``columns`` (lists of equal length, position k of each belonging together) split by the device and
    dtype of the first column's tensor k: a fused kernel takes tensors of one device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
    for k, p in enumerate(columns[0]):
        group = groups.setdefault((p.device, p.dtype), [[] for _ in columns])
        for column, tensors in zip(group, columns, strict=True):
            column.append(tensors[k])
    return list(groups.values())


class Adam(Optimizer):
    """Adam, or AdamW with ``decoupled_weight_decay`` (the formulas in the module docstring)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 decoupled_weight_decay: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled_weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
        params = self._with_grads()
        for p in params:
            if p not in self.state:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        columns = [params, [p.grad for p in params],
                   *([self.state[p][name] for p in params] for name in ("step", "exp_avg", "exp_avg_sq"))]
        for params_, grads, steps, exp_avgs, exp_avg_sqs in by_device_and_dtype(columns):
            torch._foreach_add_(steps, 1)
            kernel(params_, grads, exp_avgs, exp_avg_sqs, [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                   weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False)


class SGD(Optimizer):
    """SGD, with a momentum buffer per parameter where ``momentum > 0`` (the formula in the module
    docstring; with ``momentum = 0`` no state)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        momentum = group["momentum"]
        params = self._with_grads()
        if momentum:
            for p in params:
                if p not in self.state:  # b = mu * 0 + g: exactly g, the first step's buffer
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)}
        buffers = [[self.state[p]["momentum_buffer"] for p in params]] if momentum else []
        for params_, grads, *buffer in by_device_and_dtype([params, [p.grad for p in params], *buffers]):
            torch._fused_sgd_(params_, grads, buffer[0] if buffer else [], lr=group["lr"],
                              weight_decay=group["weight_decay"], momentum=momentum, dampening=0.0,
                              nesterov=False, maximize=False, is_first_step=False)
