// XLA FFI handler for the sparse MLA (DSA) forward on sm_90a.
//
// Kernels: ffi/kernels/sm90/fwd_pingpong.py and fwd_small_heads.py, exported by ffi/build.py as
// jax_dsa_fwd_<kernel>_<dtype>_d<Dqk> and listed in JAX_DSA_FWD_SPECS. Which kernel runs is the
// caller's choice, passed as the `kernel` attribute (jax_dsa.cute.config.FwdConfig.kernel).
// The kernels take flattened row-major views, so this file only checks the buffers, fills the
// exported tensor structs ({data, dynamic_shapes}) and launches on XLA's stream.
//
//   args:  q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk] (dtype of q), idx [B, T, K] int32,
//          topk_length [B, T] int32, sink [H] f32 (-inf: no sink)
//   attrs: scale (f32), kernel (string: "pingpong", "small_heads" or "pingpong_split"),
//          poison (int32, tests: NaN-fill the outputs before the launch, so that unwritten
//          elements show)
//   rets:  o [B, T, H, 512] (dtype of q), lse [B, T, H] f32; for "pingpong_split" (decode)
//          o [B, T, P, H, 512] and lse [B, T, P, H]: each token's list as P contiguous parts
//          of ceil(K / P) entries, each part's softmax without the sink (the caller combines
//          the parts by their lse and adds the sink)

#include "common.h"  // first: defines the loaders' error hook

#include <cstdint>
#include <string>
#include <string_view>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// Kernel launch arguments in the kernels' flattened form.
struct FwdArgs {
  void *q, *kv, *idx, *len, *sink, *o, *lse;
  int64_t rows_q, rows_kv, n_idx, n_tok, n_head, rows_o;
  int32_t B, T, H, S, K;
  float scale;
};

#define JAX_DSA_FWD_SPEC(PREFIX)                                                \
  JAX_DSA_SPEC(PREFIX) {                                                        \
    static int32_t launch(const FwdArgs& a, cudaStream_t s) {                   \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                  \
      PREFIX##_Tensor_mKV_t kv{a.kv, {a.rows_kv}};                              \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                             \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                             \
      PREFIX##_Tensor_mSink_t sink{a.sink, {a.n_head}};                         \
      PREFIX##_Tensor_mO_t o{a.o, {a.rows_o}};                                  \
      PREFIX##_Tensor_mLse_t lse{a.lse, {a.rows_o}};                            \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &kv, &idx, &len, &sink, \
                                         &o, &lse, a.B, a.T, a.H, a.S, a.K,     \
                                         a.scale, s);                           \
    }                                                                           \
  };
JAX_DSA_FWD_SPECS(JAX_DSA_FWD_SPEC)
#undef JAX_DSA_FWD_SPEC

KernelTable<FwdArgs>& FwdKernels() {
  static KernelTable<FwdArgs> table{JAX_DSA_FWD_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

ffi::Error SparseMlaFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                        ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                        ffi::AnyBuffer topk_length, ffi::AnyBuffer sink, float scale,
                        std::string_view kernel, int32_t poison,
                        ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla_fwd: " + m);
  };
  Extents x{};
  std::string problem = CheckInputs(q, kv, idx, topk_length, &x);
  if (!problem.empty()) return err(problem);
  const int64_t B = x.B, T = x.T, H = x.H, D = x.D, S = x.S, K = x.K;
  const auto dt = q.element_type();
  if (sink.element_type() != ffi::DataType::F32) return err("sink must be float32");
  if (o->element_type() != dt) return err("o must have the dtype of q");
  if (lse->element_type() != ffi::DataType::F32) return err("lse must be float32");
  if (!HasDims(sink.dimensions(), {H})) return err("sink must be [H], got " + Dims(sink.dimensions()));
  int64_t P = 1;  // parts per token (the split form)
  if (kernel == "pingpong_split") {
    if (o->dimensions().size() != 5 || o->dimensions()[2] < 1)
      return err("o must be [B, T, P, H, " + std::to_string(kDV) + "] with P >= 1, got " +
                 Dims(o->dimensions()));
    P = o->dimensions()[2];
    if (!HasDims(o->dimensions(), {B, T, P, H, kDV}))
      return err("o must be [B, T, P, H, " + std::to_string(kDV) + "], got " +
                 Dims(o->dimensions()));
    if (!HasDims(lse->dimensions(), {B, T, P, H}))
      return err("lse must be [B, T, P, H], got " + Dims(lse->dimensions()));
  } else {
    if (!HasDims(o->dimensions(), {B, T, H, kDV}))
      return err("o must be [B, T, H, " + std::to_string(kDV) + "], got " +
                 Dims(o->dimensions()));
    if (!HasDims(lse->dimensions(), {B, T, H}))
      return err("lse must be [B, T, H], got " + Dims(lse->dimensions()));
  }
  if (T * P * ((H + 63) / 64) > INT32_MAX)
    return err("too many (token, part, head block) CTAs for one launch");
  if (kernel == "small_heads" && H > kSmallHeads)  // it launches nothing above that
    return err("kernel small_heads takes H <= " + std::to_string(kSmallHeads) + ", got H=" +
               std::to_string(H));
  if (B == 0 || T == 0) return ffi::Error::Success();

  const std::string name = "jax_dsa_fwd_" + std::string(kernel) + "_" +
                           (dt == ffi::DataType::BF16 ? "bf16" : "f16") + "_d" +
                           std::to_string(D);
  KernelTable<FwdArgs>::Launch launch = FwdKernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd: no kernel " + name + " was built");

  DeviceGuard guard(device);
  if (!guard.ok()) return ffi::Error::Internal("jax_dsa sparse_mla_fwd: cudaSetDevice failed");
  cudaError_t le = FwdKernels().Load();
  if (le != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_dsa: loading the kernels failed: ") +
                                cudaGetErrorString(le));

  if (poison) {  // all-ones bytes are NaN in bf16, f16 and f32
    cudaMemsetAsync(o->untyped_data(), 0xFF, o->size_bytes(), stream);
    cudaMemsetAsync(lse->untyped_data(), 0xFF, lse->size_bytes(), stream);
  }

  FwdArgs a;
  a.q = q.untyped_data();
  a.kv = kv.untyped_data();
  a.idx = idx.untyped_data();
  a.len = topk_length.untyped_data();
  a.sink = sink.untyped_data();
  a.o = o->untyped_data();
  a.lse = lse->untyped_data();
  a.rows_q = B * T * H;
  a.rows_kv = B * S;
  a.n_idx = B * T * K;
  a.n_tok = B * T;
  a.n_head = H;
  a.rows_o = B * T * P * H;
  a.B = static_cast<int32_t>(B);
  a.T = static_cast<int32_t>(T);
  a.H = static_cast<int32_t>(H);
  a.S = static_cast<int32_t>(S);
  a.K = static_cast<int32_t>(K);
  a.scale = scale;

  return LaunchStatus("sparse_mla_fwd", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdSm90, jax_dsa::SparseMlaFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // sink
                                  .Attr<float>("scale")
                                  .Attr<std::string_view>("kernel")
                                  .Attr<int32_t>("poison")
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>(),  // lse
                              {ffi::Traits::kCmdBufferCompatible});

// Loads every forward kernel module now (on all devices), outside any CUDA graph capture.
// Returns 0 or a cudaError_t code.
extern "C" __attribute__((visibility("default"))) int JaxDsaInit() {
  return static_cast<int>(jax_dsa::FwdKernels().Load());
}
