// XLA FFI handlers of the indexer loss on sm_90a (ffi/kernels/sm90/indexer_loss.py, exported
// by ffi/build.py as jax_dsa_indexer_loss_{fwd,bwd}_<dtype>, listed in JAX_DSA_LOSS_FWD_SPECS
// and JAX_DSA_LOSS_BWD_SPECS). Common args: q [B, T, Hi, 128] bf16/f16, k [B, S, 128] (dtype
// of q), w [B, T, Hi] f32, idx [B, T, K] int32 (K <= kIndexerLossMaxK), topk_length [B, T]
// int32; attr scale (f32).
//
// JaxDsaIndexerLossFwdSm90: the per-token KL(target || softmax of the selected indexer scores).
//   args:  (common), target [B, T, K] f32
//   rets:  kl [B, T] f32, signal [B, T, K] f32 (per entry: p_j sum(target) - target_j, 0 at
//          the invalid entries; the backward's input)
//
// JaxDsaIndexerLossBwdSm90: dq, dweights and dk of sum_t g_t KL_t.
//   args:  (common), signal [B, T, K] f32 (the forward's), g [B, T] f32 (the per-token KL's
//          cotangent)
//   rets:  dq [B, T, Hi, 128] f32, dw [B, T, Hi] f32, dk [B, S, 128] f32 (zero-filled here,
//          then added to by the kernel)

#include "common.h"  // first: defines the loaders' error hook

#include <cstdint>
#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// Every tensor the two kernels may take (`entries`: the per-entry float32 input, the target
// of the forward or the signal of the backward; the forward's kl rides in `out` and its
// signal in `signal`); extents as the exported wrappers want them.
struct LossArgs {
  void *q, *k, *w, *idx, *len, *entries, *signal, *g, *dq, *dw, *dk, *out;
  int64_t rows_q, rows_k, n_idx, n_tok, n_dq;
  int32_t B, T, Hi, S, K;
  float scale;
};

#define JAX_DSA_LOSS_FWD_SPEC(PREFIX)                                                      \
  JAX_DSA_SPEC(PREFIX) {                                                                   \
    static int32_t launch(const LossArgs& a, cudaStream_t s) {                             \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                             \
      PREFIX##_Tensor_mK_t k{a.k, {a.rows_k}};                                             \
      PREFIX##_Tensor_mW_t w{a.w, {a.rows_q}};                                             \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                        \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                        \
      PREFIX##_Tensor_mTarget_t target{a.entries, {a.n_idx}};                              \
      PREFIX##_Tensor_mKL_t kl{a.out, {a.n_tok}};                                          \
      PREFIX##_Tensor_mSig_t sig{a.signal, {a.n_idx}};                                     \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &k, &w, &idx, &len, &target, &kl,  \
                                         &sig, a.B, a.T, a.Hi, a.S, a.K, a.scale, s);      \
    }                                                                                      \
  };
JAX_DSA_LOSS_FWD_SPECS(JAX_DSA_LOSS_FWD_SPEC)
#undef JAX_DSA_LOSS_FWD_SPEC

#define JAX_DSA_LOSS_BWD_SPEC(PREFIX)                                                        \
  JAX_DSA_SPEC(PREFIX) {                                                                     \
    static int32_t launch(const LossArgs& a, cudaStream_t s) {                               \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                               \
      PREFIX##_Tensor_mK_t k{a.k, {a.rows_k}};                                               \
      PREFIX##_Tensor_mW_t w{a.w, {a.rows_q}};                                               \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                          \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                          \
      PREFIX##_Tensor_mSig_t sig{a.entries, {a.n_idx}};                                      \
      PREFIX##_Tensor_mG_t g{a.g, {a.n_tok}};                                                \
      PREFIX##_Tensor_mDQ_t dq{a.dq, {a.n_dq}};                                              \
      PREFIX##_Tensor_mDW_t dw{a.dw, {a.rows_q}};                                            \
      PREFIX##_Tensor_mDK_t dk{a.dk, {a.rows_k}};                                            \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &k, &w, &idx, &len, &sig, &g, &dq,  \
                                         &dw, &dk, a.B, a.T, a.Hi, a.S, a.K,                 \
                                         a.scale, s);                                        \
    }                                                                                        \
  };
JAX_DSA_LOSS_BWD_SPECS(JAX_DSA_LOSS_BWD_SPEC)
#undef JAX_DSA_LOSS_BWD_SPEC

KernelTable<LossArgs>& LossFwdKernels() {
  static KernelTable<LossArgs> table{JAX_DSA_LOSS_FWD_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

KernelTable<LossArgs>& LossBwdKernels() {
  static KernelTable<LossArgs> table{JAX_DSA_LOSS_BWD_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

// Checks the inputs both handlers take and fills the common part of `a` (pointers, extents,
// scale); `entries` is the per-entry float32 input called `name` (target or signal). Returns
// the message for ffi::Error, or an empty string.
std::string CheckInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& w, const ffi::AnyBuffer& idx,
                        const ffi::AnyBuffer& topk_length, const ffi::AnyBuffer& entries,
                        const char* name, float scale, LossArgs* a) {
  auto qd = q.dimensions(), kd = k.dimensions(), id = idx.dimensions();
  const auto dt = q.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16)
    return "q must be bfloat16 or float16";
  if (qd.size() != 4 || qd[3] != kIndexerDim) return "q must be [B, T, Hi, 128], got " + Dims(qd);
  const int64_t B = qd[0], T = qd[1], Hi = qd[2];
  if (Hi < 1 || Hi > kIndexerMaxHeads)
    return "Hi must be in 1.." + std::to_string(kIndexerMaxHeads) + ", got " +
           std::to_string(Hi);
  if (k.element_type() != dt) return "k must have the dtype of q";
  if (kd.size() != 3 || kd[0] != B || kd[2] != kIndexerDim)
    return "k must be [B, S, 128] with q's B, got " + Dims(kd);
  const int64_t S = kd[1];
  if (w.element_type() != ffi::DataType::F32 || !HasDims(w.dimensions(), {B, T, Hi}))
    return "w must be float32 [B, T, Hi], got " + Dims(w.dimensions());
  if (idx.element_type() != ffi::DataType::S32 || id.size() != 3 || id[0] != B || id[1] != T)
    return "idx must be int32 [B, T, K], got " + Dims(id);
  const int64_t K = id[2];
  if (K < 1 || K > kIndexerLossMaxK)
    return "K must be in 1.." + std::to_string(kIndexerLossMaxK) + ", got " + std::to_string(K);
  if (topk_length.element_type() != ffi::DataType::S32 ||
      !HasDims(topk_length.dimensions(), {B, T}))
    return "topk_length must be int32 [B, T], got " + Dims(topk_length.dimensions());
  if (entries.element_type() != ffi::DataType::F32 || !HasDims(entries.dimensions(), {B, T, K}))
    return std::string(name) + " must be float32 [B, T, K], got " + Dims(entries.dimensions());
  // Kernel scalars are int32; the flattened token b * T + t is the grid's x index.
  if (B * T > INT32_MAX || S > INT32_MAX || B > 65535)
    return "need B * T, S < 2^31 and B <= 65535";
  a->q = q.untyped_data();
  a->k = k.untyped_data();
  a->w = w.untyped_data();
  a->idx = idx.untyped_data();
  a->len = topk_length.untyped_data();
  a->entries = entries.untyped_data();
  a->rows_q = B * T * Hi;
  a->rows_k = B * S;
  a->n_idx = B * T * K;
  a->n_tok = B * T;
  a->n_dq = B * T * Hi * kIndexerDim;
  a->B = static_cast<int32_t>(B);
  a->T = static_cast<int32_t>(T);
  a->Hi = static_cast<int32_t>(Hi);
  a->S = static_cast<int32_t>(S);
  a->K = static_cast<int32_t>(K);
  a->scale = scale;
  return std::string();
}

// Checks the backward's g and gradient buffers against the extents in `a`.
std::string CheckGradients(const ffi::AnyBuffer& g, const ffi::AnyBuffer& dq,
                           const ffi::AnyBuffer& dw, const ffi::AnyBuffer& dk,
                           const LossArgs& a) {
  const int64_t B = a.B, T = a.T, Hi = a.Hi, S = a.S;
  if (g.element_type() != ffi::DataType::F32 || !HasDims(g.dimensions(), {B, T}))
    return "g must be float32 [B, T], got " + Dims(g.dimensions());
  if (dq.element_type() != ffi::DataType::F32 ||
      !HasDims(dq.dimensions(), {B, T, Hi, kIndexerDim}))
    return "dq must be float32 [B, T, Hi, 128], got " + Dims(dq.dimensions());
  if (dw.element_type() != ffi::DataType::F32 || !HasDims(dw.dimensions(), {B, T, Hi}))
    return "dw must be float32 [B, T, Hi], got " + Dims(dw.dimensions());
  if (dk.element_type() != ffi::DataType::F32 || !HasDims(dk.dimensions(), {B, S, kIndexerDim}))
    return "dk must be float32 [B, S, 128], got " + Dims(dk.dimensions());
  return std::string();
}

// The launcher of `part`'s kernel for q's dtype, or an error.
ffi::Error FindKernel(KernelTable<LossArgs>& table, const char* part, ffi::DataType dt,
                      KernelTable<LossArgs>::Launch* launch) {
  const std::string name = std::string("jax_dsa_indexer_loss_") + part + "_" +
                           (dt == ffi::DataType::BF16 ? "bf16" : "f16");
  *launch = table.Find(name);
  if (*launch == nullptr)
    return ffi::Error::Internal("jax_dsa indexer_loss: no kernel " + name + " was built");
  return ffi::Error::Success();
}

ffi::Error IndexerLossFwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                          ffi::AnyBuffer k, ffi::AnyBuffer w, ffi::AnyBuffer idx,
                          ffi::AnyBuffer topk_length, ffi::AnyBuffer target, float scale,
                          ffi::Result<ffi::AnyBuffer> kl, ffi::Result<ffi::AnyBuffer> signal) {
  LossArgs a{};
  std::string msg = CheckInputs(q, k, w, idx, topk_length, target, "target", scale, &a);
  if (msg.empty() && (kl->element_type() != ffi::DataType::F32 ||
                      !HasDims(kl->dimensions(), {a.B, a.T})))
    msg = "kl must be float32 [B, T], got " + Dims(kl->dimensions());
  if (msg.empty() && (signal->element_type() != ffi::DataType::F32 ||
                      !HasDims(signal->dimensions(), {a.B, a.T, a.K})))
    msg = "signal must be float32 [B, T, K], got " + Dims(signal->dimensions());
  if (!msg.empty()) return ffi::Error::InvalidArgument("jax_dsa indexer_loss: " + msg);
  if (a.n_tok == 0) return ffi::Error::Success();
  KernelTable<LossArgs>::Launch launch;
  ffi::Error found = FindKernel(LossFwdKernels(), "fwd", q.element_type(), &launch);
  if (found.failure()) return found;
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("indexer_loss", guard, LossFwdKernels()); e.failure()) return e;
  a.out = kl->untyped_data();
  a.signal = signal->untyped_data();
  return LaunchStatus("indexer_loss", launch(a, stream));
}

ffi::Error IndexerLossBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                          ffi::AnyBuffer k, ffi::AnyBuffer w, ffi::AnyBuffer idx,
                          ffi::AnyBuffer topk_length, ffi::AnyBuffer signal,
                          ffi::AnyBuffer g, float scale,
                          ffi::Result<ffi::AnyBuffer> dq,
                          ffi::Result<ffi::AnyBuffer> dw, ffi::Result<ffi::AnyBuffer> dk) {
  LossArgs a{};
  std::string msg = CheckInputs(q, k, w, idx, topk_length, signal, "signal", scale, &a);
  if (msg.empty()) msg = CheckGradients(g, *dq, *dw, *dk, a);
  if (!msg.empty())
    return ffi::Error::InvalidArgument("jax_dsa indexer_loss backward: " + msg);
  KernelTable<LossArgs>::Launch launch;
  ffi::Error found = FindKernel(LossBwdKernels(), "bwd", q.element_type(), &launch);
  if (found.failure()) return found;
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("indexer_loss backward", guard, LossBwdKernels()); e.failure())
    return e;
  cudaMemsetAsync(dk->untyped_data(), 0, dk->size_bytes(), stream);
  if (a.n_tok == 0) return LaunchStatus("indexer_loss backward", 0);
  a.g = g.untyped_data();
  a.dq = dq->untyped_data();
  a.dw = dw->untyped_data();
  a.dk = dk->untyped_data();
  return LaunchStatus("indexer_loss backward", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerLossFwdSm90, jax_dsa::IndexerLossFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // target
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()   // kl
                                  .Ret<ffi::AnyBuffer>(),  // signal
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerLossBwdSm90, jax_dsa::IndexerLossBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // signal
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()   // dq
                                  .Ret<ffi::AnyBuffer>()   // dw
                                  .Ret<ffi::AnyBuffer>(),  // dk
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaLossInit, jax_dsa::LossFwdKernels(), jax_dsa::LossBwdKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaLossNumKernels, jax_dsa::LossFwdKernels(),  // forward and
                           jax_dsa::LossBwdKernels())                        // backward
