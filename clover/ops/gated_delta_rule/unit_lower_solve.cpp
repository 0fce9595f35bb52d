// X = (I + L)^-1 R for the gated delta rule's per-chunk systems (chunk.py): `system` [..., C, C] is
// unit lower-triangular (its diagonal and upper part are not read), `rhs` [..., C, N], fp32 CPU.
// Row by row forward substitution, x_i = r_i - sum_{j<i} L_ij x_j (j ascending), each row an axpy
// over N that the compiler vectorises. For a decode step's small chunks torch.linalg.solve_triangular
// spends far more on column-major copies and one MKL trsm call per matrix than on the work. Bound into
// the extension that ops/linear/tiled.py builds (clover_cpu_ops); compiled CPU graphs send their unit
// lower-triangular solves here (ops.gated_delta_rule.graph_solve_kernel); eager keeps torch's.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include "../linear/define_op.h"

namespace {

at::Tensor unit_lower_solve(const at::Tensor& system, const at::Tensor& rhs) {
  TORCH_CHECK(system.dim() >= 2 && rhs.dim() == system.dim(), "clover_cpu::unit_lower_solve: bad ranks");
  TORCH_CHECK(system.scalar_type() == at::kFloat && rhs.scalar_type() == at::kFloat,
              "clover_cpu::unit_lower_solve: fp32 only");
  const int64_t C = system.size(-1), N = rhs.size(-1);
  TORCH_CHECK(system.size(-2) == C && rhs.size(-2) == C, "clover_cpu::unit_lower_solve: shapes disagree");
  for (int64_t d = 0; d < system.dim() - 2; ++d)
    TORCH_CHECK(system.size(d) == rhs.size(d), "clover_cpu::unit_lower_solve: batch shapes disagree");
  const at::Tensor a = system.contiguous(), r = rhs.contiguous();
  at::Tensor out = at::empty(rhs.sizes(), rhs.options());
  const int64_t batch = C && N ? rhs.numel() / (C * N) : 0;
  const float* A = a.data_ptr<float>();
  const float* R = r.data_ptr<float>();
  float* X = out.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const float* Ab = A + b * C * C;
    const float* Rb = R + b * C * N;
    float* Xb = X + b * C * N;
    for (int64_t i = 0; i < C; ++i) {
      float* __restrict__ xi = Xb + i * N;
      const float* __restrict__ ri = Rb + i * N;
      for (int64_t n = 0; n < N; ++n) xi[n] = ri[n];
      for (int64_t j = 0; j < i; ++j) {
        const float l = Ab[i * C + j];
        const float* __restrict__ xj = Xb + j * N;
        for (int64_t n = 0; n < N; ++n) xi[n] -= l * xj[n];
      }
    }
  }
  return out;
}

}  // namespace

CLOVER_CPU_OP(unit_lower_solve, "(Tensor system, Tensor rhs) -> Tensor")

// The C entry point a compiled graph calls directly (see tiled.cpp's C entry points).
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_unit_lower_solve(
    AtenTensorHandle system, AtenTensorHandle rhs, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using namespace torch::aot_inductor;
    *ret0 = new_tensor_handle(unit_lower_solve(*tensor_handle_to_tensor_pointer(system), *tensor_handle_to_tensor_pointer(rhs)));
  });
}
