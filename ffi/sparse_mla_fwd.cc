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
//
// JaxDsaSparseMlaFwdTwoPoolSm90 (kernel jax_dsa_fwd_two_pool_<dtype>_d<Dqk>): two KV pools in
// one softmax, each entry read from its own pool.
//   args:  q, kv, idx, topk_length (pool 1, as above), kv2 [B, S2, Dqk], idx2 [B, T, K2] int32,
//          topk_length2 [B, T] int32, sink [H] f32
//   attrs: scale, poison; rets: o [B, T, H, 512], lse [B, T, H]

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

struct Fwd2Args {
  FwdArgs a;  // pool 1, q, sink and the outputs
  void *kv2, *idx2, *len2;
  int64_t rows_kv2, n_idx2;
  int32_t S2, K2;
};

#define JAX_DSA_FWD2_SPEC(PREFIX)                                                     \
  JAX_DSA_SPEC(PREFIX) {                                                              \
    static int32_t launch(const Fwd2Args& x, cudaStream_t s) {                        \
      const FwdArgs& a = x.a;                                                         \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                        \
      PREFIX##_Tensor_mKV_t kv{a.kv, {a.rows_kv}};                                    \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                   \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                   \
      PREFIX##_Tensor_mKV2_t kv2{x.kv2, {x.rows_kv2}};                                \
      PREFIX##_Tensor_mIdx2_t idx2{x.idx2, {x.n_idx2}};                               \
      PREFIX##_Tensor_mLen2_t len2{x.len2, {a.n_tok}};                                \
      PREFIX##_Tensor_mSink_t sink{a.sink, {a.n_head}};                               \
      PREFIX##_Tensor_mO_t o{a.o, {a.rows_q}};                                        \
      PREFIX##_Tensor_mLse_t lse{a.lse, {a.rows_q}};                                  \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &kv, &idx, &len, &kv2, &idx2, \
                                         &len2, &sink, &o, &lse, a.B, a.T, a.H, a.S,  \
                                         a.K, x.S2, x.K2, a.scale, s);                \
    }                                                                                 \
  };
JAX_DSA_FWD2_SPECS(JAX_DSA_FWD2_SPEC)
#undef JAX_DSA_FWD2_SPEC

KernelTable<Fwd2Args>& Fwd2Kernels() {
  static KernelTable<Fwd2Args> table{JAX_DSA_FWD2_SPECS(JAX_DSA_KERNEL_ENTRY)};
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

ffi::Error SparseMlaFwdTwoPool(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                               ffi::AnyBuffer kv, ffi::AnyBuffer idx, ffi::AnyBuffer topk_length,
                               ffi::AnyBuffer kv2, ffi::AnyBuffer idx2,
                               ffi::AnyBuffer topk_length2, ffi::AnyBuffer sink, float scale,
                               int32_t poison, ffi::Result<ffi::AnyBuffer> o,
                               ffi::Result<ffi::AnyBuffer> lse) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla_fwd_two_pool: " + m);
  };
  Extents x{}, x2{};
  std::string problem = CheckInputs(q, kv, idx, topk_length, &x);
  if (!problem.empty()) return err(problem);
  problem = CheckInputs(q, kv2, idx2, topk_length2, &x2);
  if (!problem.empty()) return err("pool 2: " + problem);
  const int64_t B = x.B, T = x.T, H = x.H, D = x.D;
  const auto dt = q.element_type();
  if (x.K < 1) return err("pool 1's list must have at least one entry");
  if (sink.element_type() != ffi::DataType::F32) return err("sink must be float32");
  if (o->element_type() != dt) return err("o must have the dtype of q");
  if (lse->element_type() != ffi::DataType::F32) return err("lse must be float32");
  if (!HasDims(sink.dimensions(), {H})) return err("sink must be [H], got " + Dims(sink.dimensions()));
  if (!HasDims(o->dimensions(), {B, T, H, kDV}))
    return err("o must be [B, T, H, " + std::to_string(kDV) + "], got " + Dims(o->dimensions()));
  if (!HasDims(lse->dimensions(), {B, T, H}))
    return err("lse must be [B, T, H], got " + Dims(lse->dimensions()));
  if (B == 0 || T == 0) return ffi::Error::Success();

  const std::string name = "jax_dsa_fwd_two_pool_" +
                           std::string(dt == ffi::DataType::BF16 ? "bf16" : "f16") + "_d" +
                           std::to_string(D);
  KernelTable<Fwd2Args>::Launch launch = Fwd2Kernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd_two_pool: no kernel " + name +
                                " was built");

  DeviceGuard guard(device);
  if (!guard.ok())
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd_two_pool: cudaSetDevice failed");
  cudaError_t le = Fwd2Kernels().Load();
  if (le != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_dsa: loading the kernels failed: ") +
                                cudaGetErrorString(le));

  if (poison) {  // all-ones bytes are NaN in bf16, f16 and f32
    cudaMemsetAsync(o->untyped_data(), 0xFF, o->size_bytes(), stream);
    cudaMemsetAsync(lse->untyped_data(), 0xFF, lse->size_bytes(), stream);
  }

  Fwd2Args y;
  FwdArgs& a = y.a;
  a.q = q.untyped_data();
  a.kv = kv.untyped_data();
  a.idx = idx.untyped_data();
  a.len = topk_length.untyped_data();
  a.sink = sink.untyped_data();
  a.o = o->untyped_data();
  a.lse = lse->untyped_data();
  a.rows_q = B * T * H;
  a.rows_kv = B * x.S;
  a.n_idx = B * T * x.K;
  a.n_tok = B * T;
  a.n_head = H;
  a.rows_o = a.rows_q;
  a.B = static_cast<int32_t>(B);
  a.T = static_cast<int32_t>(T);
  a.H = static_cast<int32_t>(H);
  a.S = static_cast<int32_t>(x.S);
  a.K = static_cast<int32_t>(x.K);
  a.scale = scale;
  y.kv2 = kv2.untyped_data();
  y.idx2 = idx2.untyped_data();
  y.len2 = topk_length2.untyped_data();
  y.rows_kv2 = B * x2.S;
  y.n_idx2 = B * T * x2.K;
  y.S2 = static_cast<int32_t>(x2.S);
  y.K2 = static_cast<int32_t>(x2.K);

  return LaunchStatus("sparse_mla_fwd_two_pool", launch(y, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdTwoPoolSm90, jax_dsa::SparseMlaFwdTwoPool,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // kv2
                                  .Arg<ffi::AnyBuffer>()  // idx2
                                  .Arg<ffi::AnyBuffer>()  // topk_length2
                                  .Arg<ffi::AnyBuffer>()  // sink
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("poison")
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>(),  // lse
                              {ffi::Traits::kCmdBufferCompatible});

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
  cudaError_t e = jax_dsa::FwdKernels().Load();
  if (e != cudaSuccess) return static_cast<int>(e);
  return static_cast<int>(jax_dsa::Fwd2Kernels().Load());
}

// Number of two-pool forward specializations built into this library.
extern "C" __attribute__((visibility("default"))) int JaxDsaFwdTwoPoolNumKernels() {
  return jax_dsa::Fwd2Kernels().size();
}
