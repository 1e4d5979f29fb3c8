"""How far a layout is from the reference, and when that is far enough to fail.

The error of a tensor is ||actual - expected|| / ||expected|| (Frobenius norms, float64); of a set of
tensors (all gradients, all parameters) the worst tensor's and the whole set's as one vector
("all"). A gradient that is zero in exact arithmetic holds only rounding noise, which two correct
computations do not share, so its own size is no yardstick: a reference whose largest element is at
most NOISE_EPS float32 epsilons of the set's largest element (tests/compare.py's rule) is measured
against the norm of the whole set instead.

Quantities, each the worst over the steps; every step compares the layout with the reference at the
same parameters (runner.py: the reference follows the layout's updates):
  loss, grad_norm    the step's global mean loss and gradient norm (before clipping)
  grads              every gradient before clipping, gathered to its full shape
  params             the parameters after the step against AdamW on one device applied to the same
                     parameters and optimizer state with the layout's own (gathered, clipped)
                     gradients: the optimizer's work under the layout (sharded states, tensor-parallel
                     slices, pipeline stages). Not against a free-running reference: AdamW divides
                     each element's step by |g| + 1e-8, so a gradient element near 1e-8 (the tiny
                     config has dozens per matrix) that rounds differently moves its parameter by a
                     visible part of the learning rate: gradients that agree to 5e-6 gave parameters
                     6e-5 apart after one step, and the next step's gradients then differ by that.

Criteria (`Criteria`), as tools/verify_layouts.py and tools/verify_cp.py had them:
  * fp32: every quantity within FP32_TOLERANCE: 1e-5 on CPU (tools/verify_layouts.py), 1e-4 on CUDA
    (tools/verify_cp.py's GPU bound: the Triton kernels' chunked sums regroup under a CP split).
  * bf16 (autocast) against the fp32 reference: the loss within BF16_LOSS_TOLERANCE (1e-2); grad_norm
    and grads below 1e-2 or no worse than BF16_RATIO (1.5) times the same model under the same
    autocast on one device. bf16 alone is ~2e-2 off fp32 on all gradients and ~2.5e-2 on the GDN gate
    projections (docs/parallelism.md), so a bare 1e-2 would fail the model without any parallelism:
    the layout must add nothing beyond bf16 rounding. params (fp32 arithmetic on both sides) keeps
    the fp32 bound.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

NOISE_EPS = 1e4
REFERENCE_EPS = torch.finfo(torch.float32).eps    # the references are fp32
FP32_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}
BF16_TOLERANCE = 1e-2
BF16_LOSS_TOLERANCE = 1e-2
BF16_RATIO = 1.5

# The quantities of a layout, in table order: scalars, then (worst tensor, whole set) pairs.
TENSOR_SETS = ("grads", "params")
QUANTITIES = ("loss", "grad_norm", *(q for s in TENSOR_SETS for q in (s, s + "_all")))

TensorDiff = tuple[float, float, float]   # (||actual - expected||^2, ||expected||^2, max |expected|)


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64; the absolute difference when the reference
    is zero (0 when both are)."""
    actual = torch.as_tensor(actual).detach().double()
    expected = torch.as_tensor(expected).detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs the reference's {tuple(expected.shape)}")
    diff = (actual - expected).norm().item()
    yardstick = expected.norm().item()
    return diff / yardstick if yardstick > 0 else diff


def worst(values) -> float:
    """The largest value; NaN when any is NaN (a NaN error must fail, and Python's max skips it
    depending on the order)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def scalar_error(actual: float, expected: float) -> float:
    return relative_error(torch.tensor(float(actual)), torch.tensor(float(expected)))


def tensor_diff(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> TensorDiff:
    """What the ranks exchange per tensor: enough to rebuild every error above."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"{name}: shape {tuple(actual.shape)} gathered from the layout, "
                         f"{tuple(expected.shape)} in the reference")
    actual, expected = actual.detach().double(), expected.detach().double().to(actual.device)
    largest = expected.abs().max().item() if expected.numel() else 0.0
    return (actual - expected).pow(2).sum().item(), expected.pow(2).sum().item(), largest


@dataclass
class SetError:
    worst: float
    worst_name: str | None
    whole: float                      # the set as one vector
    noise_judged: list[str] = field(default_factory=list)   # references measured against the set


def set_error(diffs: Mapping[str, TensorDiff]) -> SetError:
    """Worst tensor and whole-set errors of {name: tensor_diff(...)}."""
    if not diffs:
        return SetError(0.0, None, 0.0)
    total_diff = sum(d for d, _, _ in diffs.values())
    scale = math.sqrt(sum(r for _, r, _ in diffs.values()))
    noise_level = NOISE_EPS * REFERENCE_EPS * max(m for _, _, m in diffs.values())
    errors, noise = {}, []
    for name, (diff, ref, largest) in diffs.items():
        yardstick = math.sqrt(ref)
        if largest <= noise_level:   # rounding noise: measured against the whole set
            noise.append(name)
            yardstick = scale
        errors[name] = math.sqrt(diff) / yardstick if yardstick > 0 else math.sqrt(diff)
    worst = max(errors, key=errors.get)
    whole = math.sqrt(total_diff) / scale if scale > 0 else math.sqrt(total_diff)
    return SetError(errors[worst], worst, whole, noise)


def merge_rank_diffs(per_rank: Iterable[Mapping[str, TensorDiff]]) -> dict[str, TensorDiff]:
    """One entry per tensor name from every rank's: replicas (dp, cp, tp copies, both pipeline
    ranks of a tied weight) should agree; the largest difference any of them shows is kept (NaN first)."""
    merged: dict[str, TensorDiff] = {}
    for diffs in per_rank:
        for name, entry in diffs.items():
            if name not in merged or not entry[0] <= merged[name][0]:
                merged[name] = tuple(entry)
    return merged


@dataclass
class Criteria:
    """The bound on each quantity (module docstring); `baseline`: bf16 on one device's errors."""
    precision: str                               # fp32 | bf16
    tolerance: float                             # fp32: the bound; bf16: the floor of the relative bounds
    loss_tolerance: float
    update_tolerance: float                      # params: fp32 arithmetic whatever the autocast
    baseline: dict[str, float] | None = None

    @classmethod
    def for_run(cls, precision: str, device_type: str, tolerance: float | None = None,
                baseline: dict[str, float] | None = None) -> Criteria:
        fp32 = FP32_TOLERANCE.get(device_type, FP32_TOLERANCE["cuda"])
        if precision == "fp32":
            bound = tolerance if tolerance is not None else fp32
            return cls("fp32", bound, bound, bound)
        if baseline is None:
            raise ValueError("the bf16 criterion needs the single-device bf16 errors (baseline)")
        bound = tolerance if tolerance is not None else BF16_TOLERANCE
        return cls("bf16", bound, BF16_LOSS_TOLERANCE, fp32, dict(baseline))

    def bound(self, quantity: str) -> float:
        if quantity == "loss":
            return self.loss_tolerance
        if quantity.startswith("params"):
            return self.update_tolerance
        if self.baseline is None:
            return self.tolerance
        return max(self.tolerance, BF16_RATIO * self.baseline.get(quantity, 0.0))

    def failures(self, errors: Mapping[str, float]) -> list[str]:
        """'quantity error > bound' for each quantity out of bounds (a NaN error fails too)."""
        out = []
        for quantity in QUANTITIES:
            if quantity in errors and not errors[quantity] <= self.bound(quantity):
                out.append(f"{quantity} {errors[quantity]:.2e} > {self.bound(quantity):.1e}")
        return out

    def describe(self) -> str:
        if self.precision == "fp32":
            return f"fp32: every error <= {self.tolerance:.0e}"
        return (f"bf16 autocast vs fp32: loss <= {self.loss_tolerance:.0e}; "
                f"params <= {self.update_tolerance:.0e}; "
                f"the rest <= max({self.tolerance:.0e}, {BF16_RATIO} x bf16 on one device)")

    def as_dict(self) -> dict:
        return {"precision": self.precision, "tolerance": self.tolerance,
                "loss_tolerance": self.loss_tolerance, "update_tolerance": self.update_tolerance,
                "bf16_ratio": BF16_RATIO if self.baseline is not None else None, "baseline": self.baseline,
                "bounds": {q: self.bound(q) for q in QUANTITIES}, "noise_eps": NOISE_EPS}


@dataclass
class Measured:
    """A run's errors: each quantity's worst over the steps, the tensors where the worst errors
    sit, and every step's numbers."""
    errors: dict[str, float]
    worst_names: dict[str, str | None]
    per_step: list[dict[str, float]]
    missing: list[str] = field(default_factory=list)   # reference parameters no rank held
    noise_judged: list[str] = field(default_factory=list)


def measure_steps(scalars: Sequence[Mapping[str, float]],
                  tensor_sets: Sequence[Mapping[str, Mapping[str, TensorDiff]]],
                  reference_names: Iterable[str]) -> Measured:
    """Fold per-step measurements into Measured: `scalars[step]` {loss, grad_norm: error},
    `tensor_sets[step]` {set name (TENSOR_SETS): {tensor name: TensorDiff merged over ranks}}."""
    expected = set(reference_names)
    per_step, worst_names, missing, noise = [], {}, set(), set()
    errors: dict[str, float] = {}
    for step_scalars, sets in zip(scalars, tensor_sets):
        row = dict(step_scalars)
        for set_name, diffs in sets.items():
            unexpected = set(diffs) - expected
            if unexpected:
                raise ValueError(f"the layout holds parameters the reference does not: {sorted(unexpected)}")
            missing |= expected - set(diffs)
            err = set_error(diffs)
            row[set_name], row[set_name + "_all"] = err.worst, err.whole
            if set_name == "grads":
                noise.update(err.noise_judged)
            if not err.worst <= errors.get(set_name, 0.0):   # NaN replaces too
                worst_names[set_name] = err.worst_name
        for quantity, value in row.items():
            if quantity not in errors or not value <= errors[quantity]:   # NaN replaces too
                errors[quantity] = value
        per_step.append(row)
    return Measured(errors, worst_names, per_step, sorted(missing), sorted(noise))
