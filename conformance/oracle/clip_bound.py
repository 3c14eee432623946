"""A derived bound for a step clipped by a global gradient norm the engine sums in its own order.

[Note: why a bound, and which]
`clip_grad_norm_(max_norm)` scales every gradient by c = min(1, M / (n̂ + ε)), n̂ the computed
L2 norm of all gradients together. A sharded engine computes n̂ from its shards: each rank
sums its shard's squares, the sums are all-reduced, a square root taken (refimpl); FSDP1 takes
per-parameter norms, their norm, raises it to the power 2, all-reduces and takes the root;
FSDP2 all-reduces DTensor partial norms. Each is another rounding order than the oracle's
torch `clip_grad_norm_` on full tensors, so the step lands 1-2 ulps away from the oracle's
bitwise step. Instead of a blanket band, the oracle derives how far any correct order can land:

1. The norm. With S = Σ g_i² over the N gradient elements (exact: computed in float64 from the
   engine's own, already judged gradients), any evaluation of √S that squares each element
   once, adds the squares in any tree and in any precision at least the gradients', and takes
   up to four (root, square) detours on the way (per-parameter, per-shard, per-group norms,
   `pow`) has every squared term through at most k = N + 16 roundings, all of them on
   non-negative terms; hence |Ŝ - S| <= γ_k·S (Higham, Accuracy and Stability, 2nd ed.,
   Lemma 3.1 and §4.2) and, with a root rounded within 2u,
       n(1 - ρ₋) <= n̂ <= n(1 + ρ₊),  1 + ρ₊ = (1 + 2u)·√(1 + γ_k),  1 - ρ₋ = (1 - 2u)·√(1 - γ_k).
2. The coefficient. c = M / (n̂ + ε) takes at most four roundings (the ε addition, a reciprocal
   and a product as torch's `M / tensor` does, or a division; a cast), then the clamp to 1:
       c ∈ [c_lo, c_hi],  c_lo = min(1, M(1-u)⁴ / (n(1+ρ₊) + ε(1+u))),
                          c_hi = min(1, M(1+u)⁴ / (n(1-ρ₋) + ε(1-u))).
   Where both ends are 1 nothing is clipped and the step stays bitwise.
3. The clipped gradient, per element: |fl(c_e·g) - fl(c_o·g)| <= δ = |g|·(c_hi - c_lo + 2u·c_hi).
4. The step (SGD: buf_t = μ·buf_{t-1} + (1-dampening)·g', p_t = p - lr·buf_t), per element:
       B_t = μ·B_{t-1} + (1-dampening)·δ_t + r_B,    |p̂_t - p_t| <= P_t = lr·B_t + r_P,
   B the bound on the engine's momentum buffer's distance from the oracle's (the oracle
   re-anchors parameters on the engine's, but its momentum buffer is its own, built with its
   own coefficients), r_B = 2u·(|buf_t| + μB_{t-1} + (1-dampening)δ_t) and r_P = 2u·(|p_t| + lr·B_t)
   the roundings of two different inputs (plus one product each where μ or lr is not a power
   of two, and 4η for underflow), added only where the inputs can differ (B, δ > 0): the same
   operation on the same inputs is bitwise.
The oracle's own norm must fall inside step 1's interval; `ClipBound.check_norm` says so loudly
if not (the derivation would be wrong). Adam and other optimizers get no bound here (refused).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from conformance.oracle.envelope import UNDERFLOW, UNIT_ROUNDOFF, Envelope, dtype_name, gamma

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s, FSDP1's and refimpl's
DETOURS = 16  # roundings allowed on a squared term beyond the N - 1 additions and its square (see [Note])


def _power_of_two(x: float) -> bool:
    return x > 0 and math.frexp(x)[0] == 0.5


class ClipBound:
    """Tracks, across steps, how far a correct engine's clipped SGD step may land from the oracle's."""

    def __init__(self, max_norm: float, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"no clip bound derived for {type(optimizer).__name__}: the sharded clip scenarios use SGD")
        group = optimizer.param_groups[0]
        if group.get("nesterov") or group.get("weight_decay") or group.get("maximize"):
            raise ValueError("no clip bound derived for SGD with nesterov, weight decay or maximize")
        self.max_norm, self.optimizer = float(max_norm), optimizer
        self.lr, self.momentum = float(group["lr"]), float(group.get("momentum", 0.0))
        self.damp = 1.0 - float(group.get("dampening", 0.0))
        self.drift: dict[int, Tensor] = {}  # id(param) -> B_{t-1}, float64
        self.previous_buf: dict[int, Tensor] = {}
        self.delta: dict[int, Tensor] = {}
        self.scale: dict[str, Tensor] = {}  # |p| + lr·|buf| per element: the report's unit (u times it)
        self.interval = (1.0, 1.0)
        self.norm_interval = (0.0, 0.0)
        self.unit = 2.0**-24

    def before_clip(self, params: list[Tensor]) -> tuple[float, float]:
        """From the gradients about to be clipped: the norm and coefficient intervals, δ per element."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            self.interval, self.delta = (1.0, 1.0), {}
            return self.interval
        u = max(UNIT_ROUNDOFF[dtype_name(g.dtype)] for g in grads)
        n_elems = sum(g.numel() for g in grads)
        squares = sum(float((g.detach().double() ** 2).sum()) for g in grads)
        slack = n_elems * 2.0**-53 * squares  # the float64 sum's own rounding
        gam = gamma(n_elems + DETOURS, u)
        n_hi = math.sqrt((squares + slack) * (1 + gam)) * (1 + 2 * u)
        n_lo = math.sqrt(max(0.0, (squares - slack) * (1 - gam))) * (1 - 2 * u)
        c_lo = min(1.0, self.max_norm * (1 - u) ** 4 / (n_hi + EPS * (1 + u)))
        c_hi = min(1.0, self.max_norm * (1 + u) ** 4 / (n_lo + EPS * (1 - u)))
        self.unit, self.interval, self.norm_interval = u, (c_lo, c_hi), (n_lo, n_hi)
        width = c_hi - c_lo + 2 * u * c_hi if c_hi > c_lo else 0.0
        self.delta = {id(p): p.grad.detach().double().abs() * width for p in params if p.grad is not None}
        return self.interval

    def check_norm(self, norm: float) -> None:
        """The oracle's own norm is one correct evaluation: it must lie in the derived interval."""
        lo, hi = self.norm_interval
        if self.delta and not lo <= norm <= hi:
            raise AssertionError(f"clip bound: the oracle's norm {norm!r} lies outside the derived [{lo!r}, {hi!r}]")

    def after_step(self, named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
        """P_t per element for every parameter the optimizer stepped (float64), after `optimizer.step()`."""
        u, eta, out = self.unit, 4 * UNDERFLOW["float32"], {}
        mu_exact, lr_exact = self.momentum == 0 or _power_of_two(self.momentum), _power_of_two(self.lr)
        for name, p in named:
            key = id(p)
            delta = self.delta.get(key)
            if delta is None:  # no gradient: SGD leaves the (re-anchored) parameter and its buffer alone
                continue
            state = self.optimizer.state.get(p, {})
            buf = state.get("momentum_buffer")
            old = self.drift.get(key)
            if self.momentum == 0 or buf is None:
                drift = delta.clone()
            elif old is None:  # the first step: the buffer is a copy of the clipped gradient (no dampening)
                drift = delta.clone()
            else:
                pre = self.momentum * old + self.damp * delta
                rounding = 2 * u * (buf.detach().double().abs() + pre) + eta
                if not mu_exact:
                    rounding = rounding + 2 * u * self.momentum * self.previous_buf[key].abs()
                drift = pre + torch.where(pre > 0, rounding, torch.zeros_like(pre))
            if buf is not None:
                self.previous_buf[key] = buf.detach().double().clone()
            self.drift[key] = drift
            out[name] = self._param_bound(p, drift, lr_exact, buf)
            step = self.lr * (buf.detach().double().abs() if buf is not None else p.grad.detach().double().abs())
            self.scale[name] = p.detach().double().abs() + step  # Σ|x_i| of the update p - lr·buf
        return out

    def _param_bound(self, p: Tensor, drift: Tensor, lr_exact: bool, buf: Tensor | None) -> Tensor:
        u = self.unit
        bound = self.lr * drift
        rounding = 2 * u * (p.detach().double().abs() + bound) + 4 * UNDERFLOW["float32"]
        if not lr_exact and buf is not None:
            rounding = rounding + 2 * u * self.lr * buf.detach().double().abs()
        return bound + torch.where(drift > 0, rounding, torch.zeros_like(bound))

    def formula(self) -> str:
        c_lo, c_hi = self.interval
        return (f"|p̂-p| <= lr·B_t + 2u(|p|+lr·B_t), B_t = μB_(t-1) + |g|(c_hi-c_lo+2u·c_hi) + rounding; "
                f"c in [{c_lo:.9g}, {c_hi:.9g}] = min(1, M(1∓u)^4/(n(1±ρ)+ε)), |n̂-n| <= ρn from γ_(N+{DETOURS}) "
                f"(lr={self.lr:g}, μ={self.momentum:g}, M={self.max_norm:g})")

    def envelopes(self, params_now: dict[str, Tensor], bounds: dict[str, Tensor]) -> dict:
        """The expected parameters: a derived-bound envelope where a bound applies, the tensor elsewhere."""
        formula = self.formula()
        out = dict(params_now)
        for name, radius in bounds.items():
            p = params_now[name]
            out[name] = Envelope(p, "derived-bound", formula, center=p.double(), radius=radius,
                                 magnitude=self.scale.get(name, p.double().abs()), unit=UNIT_ROUNDOFF[dtype_name(p.dtype)])
        return out


def applies(scenario, semantics, feats) -> bool:
    """Where the bound judges the clipped step: the sharded area (every engine there sums the
    global norm over shards, in its own order), unless the engine declares its own clipping
    arithmetic (`Semantics.clipping`, replayed exactly), and without a GradScaler (its skipped
    steps are not modelled here). A declared rule whose replay is not bitwise at the scenario's
    world size (DeepSpeed's at 3+ ranks: gloo picks the order of the partial norms) is judged by
    the bound instead, in any area."""
    if feats.clip is None or feats.grad_scaler:
        return False
    declared = getattr(semantics, "clipping", None)
    if declared is not None:
        return not declared.exact(scenario.world_size)
    return scenario.area == "sharded"
