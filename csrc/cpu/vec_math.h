// Vector math shared by the cpu kernels (attention_vec.h's logits soft cap, layer_ops_cpu.cpp's
// GELU-tanh). Header-only, on at::vec::Vectorized<float> of whatever ISA the includer is built for.
#pragma once

#include <ATen/cpu/vec/vec.h>

namespace {

// tanh(a) = sign(a) (1 - e) / (1 + e), e = exp(-2 |a|) on ATen's polynomial exp_u20 (0 for huge
// |a|, so +-1 is reached exactly). Absolute error ~2e-7 (the relative error grows as |a| -> 0,
// where callers add the result to 1 or scale it by a cap), at about a quarter of the cost of
// Sleef's 1-ulp tanhf that Vectorized<float>::tanh runs.
inline at::vec::Vectorized<float> tanh_exp_u20(const at::vec::Vectorized<float>& a) {
  using V = at::vec::Vectorized<float>;
  const V e = (a.abs() * V(-2.f)).exp_u20();
  const V one(1.f);
  const V t = (one - e) / (one + e);
  return V::blendv(t, V(0.f) - t, a < V(0.f));
}

}  // namespace
