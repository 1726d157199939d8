// XLA FFI handler of the indexer's training target on sm_90a.
//
// JaxDsaAttentionTargetSm90: each entry's attention mass summed over each block of 64 heads
// (ffi/kernels/sm90/attention_target.py, exported by ffi/build.py as
// jax_dsa_attention_target_h<64|128>_<dtype>_d<Dqk>, listed in JAX_DSA_TARGET_SPECS: 64 heads
// per CTA for H <= 64, 128 for H > 64, so that a token's rows are gathered once).
//   args:  q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk] (dtype of q), idx [B, T, K] int32,
//          topk_length [B, T] int32, off [B, T, H] f32 (logaddexp(lse, sink); +inf: dead head)
//   attrs: scale (f32), poison (int32, tests: NaN-fill mass before the launch, so that
//          unwritten elements show)
//   rets:  mass [B, T, ceil(H / 64), K] f32 (0 at invalid entries)

#include "common.h"  // first: defines the loaders' error hook

#include <cstdint>
#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

struct TargetArgs {
  void *q, *kv, *idx, *len, *off, *mass;
  int64_t rows_q, rows_kv, n_idx, n_tok, n_mass;
  int32_t B, T, H, S, K;
  float scale;
};

#define JAX_DSA_TARGET_SPEC(PREFIX)                                                      \
  JAX_DSA_SPEC(PREFIX) {                                                                 \
    static int32_t launch(const TargetArgs& a, cudaStream_t s) {                         \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                           \
      PREFIX##_Tensor_mKV_t kv{a.kv, {a.rows_kv}};                                       \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                      \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                      \
      PREFIX##_Tensor_mOff_t off{a.off, {a.rows_q}};                                     \
      PREFIX##_Tensor_mMass_t mass{a.mass, {a.n_mass}};                                  \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &kv, &idx, &len, &off, &mass, a.B, \
                                         a.T, a.H, a.S, a.K, a.scale, s);                \
    }                                                                                    \
  };
JAX_DSA_TARGET_SPECS(JAX_DSA_TARGET_SPEC)
#undef JAX_DSA_TARGET_SPEC

KernelTable<TargetArgs>& TargetKernels() {
  static KernelTable<TargetArgs> table{JAX_DSA_TARGET_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

ffi::Error AttentionTarget(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                           ffi::AnyBuffer kv, ffi::AnyBuffer idx, ffi::AnyBuffer topk_length,
                           ffi::AnyBuffer off, float scale, int32_t poison,
                           ffi::Result<ffi::AnyBuffer> mass) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa attention_target: " + m);
  };
  Extents x{};
  std::string msg = CheckInputs(q, kv, idx, topk_length, &x);
  if (!msg.empty()) return err(msg);
  const int64_t n_hb = (x.H + 63) / 64;
  if (off.element_type() != ffi::DataType::F32 || !HasDims(off.dimensions(), {x.B, x.T, x.H}))
    return err("off must be float32 [B, T, H], got " + Dims(off.dimensions()));
  if (mass->element_type() != ffi::DataType::F32 ||
      !HasDims(mass->dimensions(), {x.B, x.T, n_hb, x.K}))
    return err("mass must be float32 [B, T, ceil(H / 64), K], got " +
               Dims(mass->dimensions()));
  if (x.B * x.T == 0) return ffi::Error::Success();

  const std::string name = std::string("jax_dsa_attention_target_h") +
                           (x.H > 64 ? "128_" : "64_") +
                           (q.element_type() == ffi::DataType::BF16 ? "bf16" : "f16") + "_d" +
                           std::to_string(x.D);
  KernelTable<TargetArgs>::Launch launch = TargetKernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa attention_target: no kernel " + name + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("attention_target", guard, TargetKernels()); e.failure()) return e;

  if (poison) cudaMemsetAsync(mass->untyped_data(), 0xFF, mass->size_bytes(), stream);

  TargetArgs a;
  a.q = q.untyped_data();
  a.kv = kv.untyped_data();
  a.idx = idx.untyped_data();
  a.len = topk_length.untyped_data();
  a.off = off.untyped_data();
  a.mass = mass->untyped_data();
  a.rows_q = x.B * x.T * x.H;
  a.rows_kv = x.B * x.S;
  a.n_idx = x.B * x.T * x.K;
  a.n_tok = x.B * x.T;
  a.n_mass = x.B * x.T * n_hb * x.K;
  a.B = static_cast<int32_t>(x.B);
  a.T = static_cast<int32_t>(x.T);
  a.H = static_cast<int32_t>(x.H);
  a.S = static_cast<int32_t>(x.S);
  a.K = static_cast<int32_t>(x.K);
  a.scale = scale;
  return LaunchStatus("attention_target", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaAttentionTargetSm90, jax_dsa::AttentionTarget,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // off
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("poison")
                                  .Ret<ffi::AnyBuffer>(),  // mass
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaTargetInit, jax_dsa::TargetKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaTargetNumKernels, jax_dsa::TargetKernels())
