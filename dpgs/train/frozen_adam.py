"""Adam with its second moment frozen: the optimizer of compressed steps with
``dpgs.compression.second_moment=frozen`` (1-bit Adam's split, Tang et al. 2021).

Adam divides each coordinate's momentum by ``sqrt(v_hat) + eps``, and that is not linear in the gradient:
a coordinate that top-k sends once every T steps arrives as one burst of T gradients, grows ``v`` with it
and moves about ``sqrt(T)`` times less than under dense Adam. Once ``v`` has settled (after dense steps)
it changes slowly, so it is frozen: every rank holds the same per-coordinate denominator

    d = max(sqrt(v_hat), floor * median_t sqrt(v_hat)) + eps        (median over the coordinates of tensor t)

and the workers send ``g / d`` (their gradient sums, preconditioned) through the error-feedback codec. The
optimizer that takes the mean ``u`` of what arrives is then linear in it, so what top-k leaves in the
residual now arrives later with the same effect:

    u' = u + wd * theta / d          (Adam: L2 decay, coupled, in the same units)
    theta <- theta * (1 - lr * wd)   (AdamW: decoupled decay)
    m <- beta1 * m + (1 - beta1) * u'
    theta <- theta - lr * m

At the switch ``m`` becomes Adam's bias-corrected first moment in the new units, ``m_hat / d``, so a dense
step right after it is the Adam step with ``v`` held (no further bias correction: 1-bit Adam's). The
floor: a coordinate whose gradient was (almost) always zero during the dense steps has ``v`` ~ 0, and its
first real gradient divided by ``eps`` would throw the weights away; Adam would have grown ``v`` there,
the frozen one cannot (measured: without it the 400-bag demo's validation AUC fell to 0.5 even with
every step dense; docs/convergence.md).
"""

from __future__ import annotations

import torch

from dpgs.train.optimizers import Adam, Optimizer


class FrozenAdam(Optimizer):
    """The update above; ``p.grad`` holds the preconditioned mean gradient ``u`` (already divided by
    ``state["denom"]``). Build it with :func:`freeze` (from an Adam or AdamW that has stepped) or
    :meth:`empty` (the skeleton a saved state is loaded into)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                 decoupled: bool, floor: float):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled_weight_decay=decoupled, second_moment_floor=floor,
                                      frozen_second_moment=True))

    @classmethod
    def empty(cls, params, groups: list[dict]) -> FrozenAdam:
        g = groups[0]
        return cls(params, g["lr"], g["betas"], g["eps"], g["weight_decay"], g["decoupled_weight_decay"],
                   g["second_moment_floor"])

    @staticmethod
    def holds(state_dict: dict) -> bool:
        """Whether an optimizer state dict is a FrozenAdam's (its param groups say so)."""
        return bool(state_dict["param_groups"]) and state_dict["param_groups"][0].get("frozen_second_moment",
                                                                                      False)

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, (beta1, _), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                u = p.grad
                if wd and group["decoupled_weight_decay"]:
                    p.mul_(1.0 - lr * wd)
                elif wd:
                    u = u + wd * p / state["denom"]
                state["exp_avg"].mul_(beta1).add_(u, alpha=1.0 - beta1)
                p.add_(state["exp_avg"], alpha=-lr)

    def denominators(self, params: list[torch.Tensor]) -> torch.Tensor:
        """``d`` of ``params`` (in that order) as one flat float32 vector."""
        return torch.cat([self.state[p]["denom"].reshape(-1) for p in params])


def floored_root(v_hat: torch.Tensor, floor: float) -> torch.Tensor:
    """``max(sqrt(v_hat), floor * median(sqrt(v_hat)))`` over one tensor."""
    root = v_hat.sqrt()
    if floor > 0:
        root = root.clamp(min=floor * float(root.reshape(-1).median()))
    return root


def freeze(adam: Optimizer, floor: float) -> FrozenAdam:
    """The FrozenAdam that continues ``adam`` (an :class:`~dpgs.train.optimizers.Adam`, AdamW included, every
    parameter stepped at least once): ``d`` from its bias-corrected second moment,
    ``m = m_hat / d``. Deterministic: every rank that freezes the same Adam state gets the same optimizer."""
    if not isinstance(adam, Adam):
        raise ValueError(f"second_moment=frozen needs Adam or AdamW, not {type(adam).__name__}")
    group = adam.param_groups[0]
    params = group["params"]
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    frozen = FrozenAdam(params, group["lr"], (beta1, beta2), eps, group["weight_decay"],
                        group["decoupled_weight_decay"], floor)
    for p in params:
        state = adam.state.get(p)
        if not state:
            raise ValueError("freezing Adam's second moment before its first step (no v yet): run dense "
                             "steps first (dpgs.compression.warmup_epochs)")
        t = float(state["step"])
        denom = floored_root(state["exp_avg_sq"] / (1.0 - beta2**t), floor).add_(eps)
        frozen.state[p] = {"exp_avg": state["exp_avg"] / (1.0 - beta1**t) / denom, "denom": denom}
    return frozen
