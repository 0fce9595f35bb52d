// What int4.cpp's ops (fp32 activations) and int4_q8.cpp's (int8 activations) share: their schemas
// (the same arguments; `kind` names the pair: "int4" for int4_linear / int4_experts, "int4_q8") and
// the routed experts on two int4 stacks with a leading expert dim.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>

#include <string>

#include "routed_experts.h"

namespace clover_int4 {

inline void define_ops(torch::Library& m, const std::string& kind) {
  m.def((kind + "_linear(Tensor x, Tensor packed, Tensor sz, int group_size, int n) -> Tensor").c_str());
  m.def((kind + "_experts(Tensor x, Tensor top_idx, Tensor top_w, Tensor gate_up, Tensor gate_up_sz, Tensor down, "
                "Tensor down_sz, int group_size, int inter) -> Tensor").c_str());
}

// Routed SwiGLU experts (routed_experts.h) on int4 stacks gate_up [E, 2I panels..] and down (the
// layout's tensors and their sz with a leading expert dim): project(in, rows, K, w, sz, out, N, panels)
// runs one expert's projection of `rows` rows of K columns into N outputs on its packed weight;
// `macs_per_work` as routed_experts'.
template <typename Project>
at::Tensor experts(const char* op, const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w,
                   const at::Tensor& gate_up, const at::Tensor& gate_up_sz, const at::Tensor& down,
                   const at::Tensor& down_sz, int64_t inter, Project&& project, int64_t macs_per_work = 1) {
  const int64_t H = x.size(1), E = gate_up.size(0), I = inter;
  const auto gu = gate_up.contiguous(), gs = gate_up_sz.contiguous(), dn = down.contiguous(), ds = down_sz.contiguous();
  const int64_t gu_n = gu.numel() / E, gs_n = gs.numel() / E, dn_n = dn.numel() / E, ds_n = ds.numel() / E;
  auto y = clover_experts::routed_experts(x, top_idx, top_w, E, I, op,
                                          [&](int64_t e, int which, const float* in, int64_t rows, float* out) {
    if (which == 0)
      project(in, rows, H, gu.data_ptr<uint8_t>() + e * gu_n, gs.data_ptr<float>() + e * gs_n, out, 2 * I, gu.size(1));
    else
      project(in, rows, I, dn.data_ptr<uint8_t>() + e * dn_n, ds.data_ptr<float>() + e * ds_n, out, H, dn.size(1));
  }, macs_per_work);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace clover_int4
