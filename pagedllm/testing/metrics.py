"""Numeric comparison against the float64 reference, and the figures each check reports.

``assert_close`` compares a backend result with the reference under the dtype's tolerance and
records (what, max |error|, NMSE) for the running check; the pytest plugin collects those
figures into the conformance report (``--conformance-report``), passed or failed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from pagedllm.testing.harness import tolerance


@dataclass
class Figure:
    what: str
    max_error: float  # max |got - ref| over all elements (inf when got is not finite)
    nmse: float  # sum (got - ref)^2 / sum ref^2
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


class _Sink:
    """Figures of the check now running (the plugin opens and closes it around each call)."""

    def __init__(self) -> None:
        self.figures: list[Figure] | None = None

    def open(self) -> None:
        self.figures = []

    def close(self) -> list[Figure]:
        figures, self.figures = self.figures or [], None
        return figures

    def add(self, figure: Figure) -> None:
        if self.figures is not None:
            self.figures.append(figure)


SINK = _Sink()


def measure(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |error|, NMSE) of ``got`` against the float64 ``ref`` (same shape)."""
    diff = got.double().cpu() - ref.double().cpu()
    if not bool(torch.isfinite(diff).all()):
        return float("inf"), float("inf")
    denom = float((ref.double() ** 2).sum()) or 1.0
    return float(diff.abs().max()) if diff.numel() else 0.0, float((diff ** 2).sum()) / denom


def assert_close(got: torch.Tensor, ref: torch.Tensor, dtype: str, what: str,
                 magnitude: torch.Tensor | None = None) -> None:
    """Every element within atol + rtol * |ref| of the reference (the dtype's tolerance), or
    atol + rtol * ``magnitude`` where the result is a sum whose terms are larger than it (a
    weighted average of values near a type's range: its rounding error scales with sum |term|)."""
    max_err, nmse = measure(got, ref)
    finite = bool(torch.isfinite(got).all())
    err = (got.double().cpu() - ref.double().cpu()).abs()
    tol = tolerance(dtype)
    scale = ref if magnitude is None else magnitude
    bound = tol["atol"] + tol["rtol"] * scale.double().cpu().abs()
    ok = finite and bool((err <= bound).all())
    SINK.add(Figure(what, max_err, nmse, ok))
    if not finite:
        raise AssertionError(f"{what}: output has non-finite values")
    if not ok:
        row, head = [int(i) for i in torch.nonzero(err > bound)[0][:2]]
        raise AssertionError(f"{what}: max |error| {max_err:.3g} (NMSE {nmse:.3g}) vs float64 "
                             f"reference (atol {tol['atol']}, rtol {tol['rtol']}); first bad "
                             f"element at token row {row}, head {head}")
