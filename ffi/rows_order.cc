// XLA FFI handler: each token's index list in row order, for the plain backward past the L2
// (ffi/kernels/sm90/rows_order.py, export jax_dsa_rows_order; jax_dsa.cute.BwdConfig.sort_rows).
//
//   args:  idx [B, T, K] int32, topk_length [B, T] int32
//   attrs: num_kv_rows (int64: S, entries outside [0, S) are invalid), ctas_per_token (int32:
//          the backward's CTAs per token, >= 1; 0: every list ascending)
//   rets:  rows [B, T, K] int32 (the valid entries ordered by row * 127 // S, the list's order
//          within a bucket, then S for every invalid entry), count [B, T] int32 (valid entries)
// The backward runs one CTA per SM, so its CTAs run in waves of SMs / ctas_per_token tokens;
// the kernel orders the lists of every other wave descending (wave = that many tokens).

#include "common.h"  // first: defines the loaders' error hook

#include <algorithm>
#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

struct RowsArgs {
  void *idx, *len, *out, *count;
  int64_t n_idx, n_tok;
  int32_t K, S, wave;
};

#define JAX_DSA_ROWS_SPEC(PREFIX)                                                       \
  JAX_DSA_SPEC(PREFIX) {                                                                \
    static int32_t launch(const RowsArgs& a, cudaStream_t s) {                          \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                     \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                     \
      PREFIX##_Tensor_mOut_t out{a.out, {a.n_idx}};                                     \
      PREFIX##_Tensor_mCount_t count{a.count, {a.n_tok}};                               \
      return cute_dsl_##PREFIX##_wrapper(&module(), &idx, &len, &out, &count,           \
                                         static_cast<int32_t>(a.n_tok), a.K, a.S,       \
                                         a.wave, s);                                    \
    }                                                                                   \
  };
JAX_DSA_ROWS_SPECS(JAX_DSA_ROWS_SPEC)
#undef JAX_DSA_ROWS_SPEC

KernelTable<RowsArgs>& RowsKernels() {
  static KernelTable<RowsArgs> table{JAX_DSA_ROWS_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

ffi::Error RowsOrder(cudaStream_t stream, int32_t device, ffi::AnyBuffer idx,
                     ffi::AnyBuffer topk_length, int64_t num_kv_rows, int32_t ctas_per_token,
                     ffi::Result<ffi::AnyBuffer> rows, ffi::Result<ffi::AnyBuffer> count) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa rows_order: " + m);
  };
  auto id = idx.dimensions(), ld = topk_length.dimensions();
  if (idx.element_type() != ffi::DataType::S32 || id.size() != 3)
    return err("idx must be int32 [B, T, K], got " + Dims(id));
  const int64_t B = id[0], T = id[1], K = id[2];
  if (topk_length.element_type() != ffi::DataType::S32 || !HasDims(ld, {B, T}))
    return err("topk_length must be int32 [B, T], got " + Dims(ld));
  if (K > INT32_MAX) return err("K must be < 2^31");
  if (num_kv_rows < 1 || num_kv_rows > INT32_MAX)
    return err("num_kv_rows must be in 1..2^31 - 1, got " + std::to_string(num_kv_rows));
  if (rows->element_type() != ffi::DataType::S32 || !HasDims(rows->dimensions(), {B, T, K}))
    return err("rows must be int32 [B, T, K], got " + Dims(rows->dimensions()));
  if (count->element_type() != ffi::DataType::S32 || !HasDims(count->dimensions(), {B, T}))
    return err("count must be int32 [B, T], got " + Dims(count->dimensions()));
  if (B * T > INT32_MAX) return err("B * T must be < 2^31");
  if (ctas_per_token < 0)
    return err("ctas_per_token must be >= 0, got " + std::to_string(ctas_per_token));
  auto launch = RowsKernels().Find("jax_dsa_rows_order");
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa rows_order: no kernel jax_dsa_rows_order was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("rows_order", guard, RowsKernels()); e.failure()) return e;
  if (B * T == 0) return ffi::Error::Success();
  if (K == 0) {  // no entries: every count is 0
    cudaError_t me = cudaMemsetAsync(count->untyped_data(), 0, count->size_bytes(), stream);
    if (me != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_dsa rows_order: ") + cudaGetErrorString(me));
    return ffi::Error::Success();
  }
  int32_t wave = 0;
  if (ctas_per_token > 0) {
    int sms = 0;
    cudaError_t ae = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (ae != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_dsa rows_order: ") + cudaGetErrorString(ae));
    wave = std::max(1, sms / ctas_per_token);
  }
  RowsArgs a{idx.untyped_data(), topk_length.untyped_data(), rows->untyped_data(),
             count->untyped_data(), B * T * K, B * T, static_cast<int32_t>(K),
             static_cast<int32_t>(num_kv_rows), wave};
  return LaunchStatus("rows_order", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaRowsOrderSm90, jax_dsa::RowsOrder,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Attr<int64_t>("num_kv_rows")
                                  .Attr<int32_t>("ctas_per_token")
                                  .Ret<ffi::AnyBuffer>()  // rows
                                  .Ret<ffi::AnyBuffer>(),  // count
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaRowsOrderInit, jax_dsa::RowsKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaRowsOrderNumKernels, jax_dsa::RowsKernels())  // 0 or 1
