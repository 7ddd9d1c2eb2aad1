"""Input checks (the weight refit's validation): which tensors hold NaN or Inf."""

from fp8_align.checks.finite import nonfinite_tensors, nonfinite_tensors_reference, start_nonfinite_check

__all__ = ["nonfinite_tensors", "nonfinite_tensors_reference", "start_nonfinite_check"]
