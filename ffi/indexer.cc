// XLA FFI handlers of the lightning indexer on sm_90a.
//
// JaxDsaIndexerScoresSm90: the scores (ffi/kernels/sm90/indexer_scores.py, exported by
// ffi/build.py as jax_dsa_indexer_scores_<dtype>, listed in JAX_DSA_INDEXER_SPECS).
//   args:  q [B, T, Hi, 128] bf16/f16, k [B, S, 128] (dtype of q), w [B, T, Hi] f32,
//          start [1] int32 (position of token 0)
//   attrs: scale (f32), ratio (int32 >= 1: positions per row of k), poison (int32, tests:
//          NaN-fill the scores before the launch, so that unwritten elements show)
//   rets:  scores [B, T, S] f32 (-inf where row s is not visible to token t)
//
// JaxDsaIndexerTopkSm90: each row's top-k by radix select (ffi/kernels/sm90/indexer_topk.py,
// exported as jax_dsa_indexer_topk_k<size> for each size of kIndexerTopkSizes, listed in
// JAX_DSA_SELECT_SPECS; a call runs the smallest size >= topk).
//   args:  scores [B, T, S] f32
//   attrs: topk (int32, 1..kIndexerMaxTopk)
//   rets:  values [B, T, topk] f32 (highest first, -inf past min(topk, S) and for -inf
//          scores), idx [B, T, topk] int32 (the columns, ties to the smaller; -1 with -inf)

#include "common.h"  // first: defines the loaders' error hook

#include <cstdint>
#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// Tokens per CTA: each CTA loads its 256 rows of k once and streams this many tokens' Q
// (256: the fastest of 64..1024 at T 4096, S 8K-128K on the H200, docs/kernel_log.md).
constexpr int32_t kTokensPerCta = 256;

struct IndexerArgs {
  void *q, *k, *w, *out, *start;
  int64_t rows_q, rows_k, n_w, n_out;
  int32_t B, T, Hi, S, ratio, tpc;
  float scale;
};

#define JAX_DSA_INDEXER_SPEC(PREFIX)                                                  \
  JAX_DSA_SPEC(PREFIX) {                                                              \
    static int32_t launch(const IndexerArgs& a, cudaStream_t s) {                     \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                        \
      PREFIX##_Tensor_mK_t k{a.k, {a.rows_k}};                                        \
      PREFIX##_Tensor_mW_t w{a.w, {a.n_w}};                                           \
      PREFIX##_Tensor_mOut_t out{a.out, {a.n_out}};                                   \
      PREFIX##_Tensor_mStart_t start{a.start, {1}};                                   \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &k, &w, &out, &start, a.B, a.T, \
                                         a.Hi, a.S, a.ratio, a.tpc, a.scale, s);      \
    }                                                                                 \
  };
JAX_DSA_INDEXER_SPECS(JAX_DSA_INDEXER_SPEC)
#undef JAX_DSA_INDEXER_SPEC

KernelTable<IndexerArgs>& IndexerKernels() {
  static KernelTable<IndexerArgs> table{JAX_DSA_INDEXER_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

ffi::Error IndexerScores(cudaStream_t stream, int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer w, ffi::AnyBuffer start, float scale, int32_t ratio,
                         int32_t poison, ffi::Result<ffi::AnyBuffer> scores) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa indexer_scores: " + m);
  };
  auto qd = q.dimensions(), kd = k.dimensions();
  const auto dt = q.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16)
    return err("q must be bfloat16 or float16");
  if (qd.size() != 4 || qd[3] != kIndexerDim)
    return err("q must be [B, T, Hi, 128], got " + Dims(qd));
  const int64_t B = qd[0], T = qd[1], Hi = qd[2];
  if (Hi < 1 || Hi > kIndexerMaxHeads)
    return err("Hi must be in 1.." + std::to_string(kIndexerMaxHeads) + ", got " +
               std::to_string(Hi));
  if (k.element_type() != dt) return err("k must have the dtype of q");
  if (kd.size() != 3 || kd[0] != B || kd[2] != kIndexerDim)
    return err("k must be [B, S, 128] with q's B, got " + Dims(kd));
  const int64_t S = kd[1];
  if (w.element_type() != ffi::DataType::F32 || !HasDims(w.dimensions(), {B, T, Hi}))
    return err("w must be float32 [B, T, Hi], got " + Dims(w.dimensions()));
  if (start.element_type() != ffi::DataType::S32 || start.element_count() != 1)
    return err("start must be one int32");
  if (scores->element_type() != ffi::DataType::F32 || !HasDims(scores->dimensions(), {B, T, S}))
    return err("scores must be float32 [B, T, S], got " + Dims(scores->dimensions()));
  if (ratio < 1) return err("ratio must be >= 1, got " + std::to_string(ratio));
  // Kernel scalars are int32: (row + 1) * ratio and start + T must not overflow.
  if (S < 1 || (S + 1) * ratio > INT32_MAX / 2 || T > INT32_MAX / 2 || B > 65535)
    return err("need S >= 1, (S + 1) * ratio < 2^30, T < 2^30 and B <= 65535");
  if (B == 0 || T == 0) return ffi::Error::Success();

  const std::string name = std::string("jax_dsa_indexer_scores_") +
                           (dt == ffi::DataType::BF16 ? "bf16" : "f16");
  KernelTable<IndexerArgs>::Launch launch = IndexerKernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa indexer_scores: no kernel " + name + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("indexer_scores", guard, IndexerKernels()); e.failure()) return e;

  if (poison) cudaMemsetAsync(scores->untyped_data(), 0xFF, scores->size_bytes(), stream);

  IndexerArgs a;
  a.q = q.untyped_data();
  a.k = k.untyped_data();
  a.w = w.untyped_data();
  a.out = scores->untyped_data();
  a.start = start.untyped_data();
  a.rows_q = B * T * Hi;
  a.rows_k = B * S;
  a.n_w = B * T * Hi;
  a.n_out = B * T * S;
  a.B = static_cast<int32_t>(B);
  a.T = static_cast<int32_t>(T);
  a.Hi = static_cast<int32_t>(Hi);
  a.S = static_cast<int32_t>(S);
  a.ratio = ratio;
  a.tpc = kTokensPerCta;
  a.scale = scale;
  return LaunchStatus("indexer_scores", launch(a, stream));
}

struct TopkArgs {
  void *scores, *idx, *val;
  int64_t n_in, n_out;
  int32_t R, S, K;
};

#define JAX_DSA_SELECT_SPEC(PREFIX)                                                        \
  JAX_DSA_SPEC(PREFIX) {                                                                   \
    static int32_t launch(const TopkArgs& a, cudaStream_t s) {                             \
      PREFIX##_Tensor_mScores_t scores{a.scores, {a.n_in}};                                \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_out}};                                        \
      PREFIX##_Tensor_mVal_t val{a.val, {a.n_out}};                                        \
      return cute_dsl_##PREFIX##_wrapper(&module(), &scores, &idx, &val, a.R, a.S, a.K, s); \
    }                                                                                      \
  };
JAX_DSA_SELECT_SPECS(JAX_DSA_SELECT_SPEC)
#undef JAX_DSA_SELECT_SPEC

KernelTable<TopkArgs>& TopkKernels() {
  static KernelTable<TopkArgs> table{JAX_DSA_SELECT_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

ffi::Error IndexerTopk(cudaStream_t stream, int32_t device, ffi::AnyBuffer scores, int32_t topk,
                       ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> idx) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa indexer_topk: " + m);
  };
  auto sd = scores.dimensions();
  if (scores.element_type() != ffi::DataType::F32 || sd.size() != 3)
    return err("scores must be float32 [B, T, S], got " + Dims(sd));
  const int64_t B = sd[0], T = sd[1], S = sd[2];
  if (topk < 1 || topk > kIndexerMaxTopk)
    return err("topk must be in 1.." + std::to_string(kIndexerMaxTopk) + ", got " +
               std::to_string(topk));
  if (values->element_type() != ffi::DataType::F32 || !HasDims(values->dimensions(), {B, T, topk}))
    return err("values must be float32 [B, T, topk], got " + Dims(values->dimensions()));
  if (idx->element_type() != ffi::DataType::S32 || !HasDims(idx->dimensions(), {B, T, topk}))
    return err("idx must be int32 [B, T, topk], got " + Dims(idx->dimensions()));
  if (S < 1 || S >= INT32_MAX || B * T > INT32_MAX)
    return err("need 1 <= S < 2^31 - 1 and B * T < 2^31");
  if (B * T == 0) return ffi::Error::Success();
  // The smallest build whose candidate buffer holds topk (more CTAs per SM).
  KernelTable<TopkArgs>::Launch launch = nullptr;
  for (int64_t size : kIndexerTopkSizes) {
    if (topk > size) continue;
    launch = TopkKernels().Find("jax_dsa_indexer_topk_k" + std::to_string(size));
    if (launch != nullptr) break;
  }
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa indexer_topk: no top-k kernel for topk " +
                                std::to_string(topk) + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("indexer_topk", guard, TopkKernels()); e.failure()) return e;
  TopkArgs a{scores.untyped_data(), idx->untyped_data(), values->untyped_data(), B * T * S,
             B * T * topk, static_cast<int32_t>(B * T), static_cast<int32_t>(S), topk};
  return LaunchStatus("indexer_topk", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerTopkSm90, jax_dsa::IndexerTopk,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // scores
                                  .Attr<int32_t>("topk")
                                  .Ret<ffi::AnyBuffer>()  // values
                                  .Ret<ffi::AnyBuffer>(),  // idx
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaIndexerScoresSm90, jax_dsa::IndexerScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // k
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Arg<ffi::AnyBuffer>()  // start
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("ratio")
                                  .Attr<int32_t>("poison")
                                  .Ret<ffi::AnyBuffer>(),  // scores
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaIndexerInit, jax_dsa::IndexerKernels(), jax_dsa::TopkKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaIndexerNumKernels, jax_dsa::IndexerKernels(),  // scores and
                           jax_dsa::TopkKernels())                              // top-k
