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
//   attrs: scale (f32), kernel (string: "pingpong" or "small_heads"), poison (int32, tests:
//          NaN-fill the outputs before the launch, so that unwritten elements show)
//   rets:  o [B, T, H, 512] (dtype of q), lse [B, T, H] f32
//
// JaxDsaSparseMlaFwdSplitSm90 (decode): each token's list as P contiguous parts of ceil(K / P)
// entries, one CTA per (token, part, head block) of jax_dsa_fwd_pingpong_split_<dtype>_d<Dqk>
// (each part's softmax without the sink), then jax_dsa_fwd_combine_<dtype> (fwd_combine.py)
// merges the parts by their lse with the sink.
//   args, attrs: as above without `kernel`
//   rets:  o, lse as above, then the parts (workspace): o_parts [B, T, P, H, 512] (dtype of q;
//          P from it), lse_parts [B, T, P, H] f32
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

KernelTable<FwdArgs>& FwdKernels() {
  static KernelTable<FwdArgs> table{JAX_DSA_FWD_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

// The split form takes FwdArgs with o / lse the parts (rows_o = B*T*P*H).
JAX_DSA_FWD_SPLIT_SPECS(JAX_DSA_FWD_SPEC)
#undef JAX_DSA_FWD_SPEC

KernelTable<FwdArgs>& FwdSplitKernels() {
  static KernelTable<FwdArgs> table{JAX_DSA_FWD_SPLIT_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

struct CombineArgs {
  void *o_parts, *lse_parts, *sink, *o, *lse;
  int64_t rows_parts, n_head, rows;
  int32_t P, H;
};

#define JAX_DSA_COMBINE_SPEC(PREFIX)                                                 \
  JAX_DSA_SPEC(PREFIX) {                                                             \
    static int32_t launch(const CombineArgs& a, cudaStream_t s) {                    \
      PREFIX##_Tensor_mOp_t op{a.o_parts, {a.rows_parts}};                           \
      PREFIX##_Tensor_mLsep_t lsep{a.lse_parts, {a.rows_parts}};                     \
      PREFIX##_Tensor_mSink_t sink{a.sink, {a.n_head}};                              \
      PREFIX##_Tensor_mO_t o{a.o, {a.rows}};                                         \
      PREFIX##_Tensor_mLse_t lse{a.lse, {a.rows}};                                   \
      return cute_dsl_##PREFIX##_wrapper(&module(), &op, &lsep, &sink, &o, &lse,     \
                                         static_cast<int32_t>(a.rows), a.P, a.H, s); \
    }                                                                                \
  };
JAX_DSA_COMBINE_SPECS(JAX_DSA_COMBINE_SPEC)
#undef JAX_DSA_COMBINE_SPEC

KernelTable<CombineArgs>& CombineKernels() {
  static KernelTable<CombineArgs> table{JAX_DSA_COMBINE_SPECS(JAX_DSA_KERNEL_ENTRY)};
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

// Checks sink, o and lse against q's extents (o [B, T, H, 512] of q's dtype, lse [B, T, H]
// f32, sink [H] f32); an empty string or the message.
std::string CheckOutputs(ffi::DataType dt, const Extents& x, const ffi::AnyBuffer& sink,
                         const ffi::AnyBuffer& o, const ffi::AnyBuffer& lse) {
  if (sink.element_type() != ffi::DataType::F32) return "sink must be float32";
  if (o.element_type() != dt) return "o must have the dtype of q";
  if (lse.element_type() != ffi::DataType::F32) return "lse must be float32";
  if (!HasDims(sink.dimensions(), {x.H})) return "sink must be [H], got " + Dims(sink.dimensions());
  if (!HasDims(o.dimensions(), {x.B, x.T, x.H, kDV}))
    return "o must be [B, T, H, " + std::to_string(kDV) + "], got " + Dims(o.dimensions());
  if (!HasDims(lse.dimensions(), {x.B, x.T, x.H}))
    return "lse must be [B, T, H], got " + Dims(lse.dimensions());
  return "";
}

// "jax_dsa_fwd_<kernel>_<dtype>_d<Dqk>"
std::string KernelName(const std::string& kernel, ffi::DataType dt, int64_t d) {
  return "jax_dsa_fwd_" + kernel + "_" + (dt == ffi::DataType::BF16 ? "bf16" : "f16") + "_d" +
         std::to_string(d);
}

void Poison(cudaStream_t stream, ffi::Result<ffi::AnyBuffer>& o,
            ffi::Result<ffi::AnyBuffer>& lse) {  // all-ones bytes are NaN in bf16, f16 and f32
  cudaMemsetAsync(o->untyped_data(), 0xFF, o->size_bytes(), stream);
  cudaMemsetAsync(lse->untyped_data(), 0xFF, lse->size_bytes(), stream);
}

// One pool's launch arguments, o / lse with rows_o rows.
FwdArgs MakeFwdArgs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& kv, const ffi::AnyBuffer& idx,
                    const ffi::AnyBuffer& topk_length, const ffi::AnyBuffer& sink, void* o,
                    void* lse, int64_t rows_o, const Extents& x, float scale) {
  FwdArgs a;
  a.q = q.untyped_data();
  a.kv = kv.untyped_data();
  a.idx = idx.untyped_data();
  a.len = topk_length.untyped_data();
  a.sink = sink.untyped_data();
  a.o = o;
  a.lse = lse;
  a.rows_q = x.B * x.T * x.H;
  a.rows_kv = x.B * x.S;
  a.n_idx = x.B * x.T * x.K;
  a.n_tok = x.B * x.T;
  a.n_head = x.H;
  a.rows_o = rows_o;
  a.B = static_cast<int32_t>(x.B);
  a.T = static_cast<int32_t>(x.T);
  a.H = static_cast<int32_t>(x.H);
  a.S = static_cast<int32_t>(x.S);
  a.K = static_cast<int32_t>(x.K);
  a.scale = scale;
  return a;
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
  if (problem.empty()) problem = CheckOutputs(q.element_type(), x, sink, *o, *lse);
  if (!problem.empty()) return err(problem);
  if (kernel == "small_heads" && x.H > kSmallHeads)  // it launches nothing above that
    return err("kernel small_heads takes H <= " + std::to_string(kSmallHeads) + ", got H=" +
               std::to_string(x.H));
  if (x.B == 0 || x.T == 0) return ffi::Error::Success();

  const std::string name = KernelName(std::string(kernel), q.element_type(), x.D);
  KernelTable<FwdArgs>::Launch launch = FwdKernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd: no kernel " + name + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("sparse_mla_fwd", guard, FwdKernels()); e.failure()) return e;
  if (poison) Poison(stream, o, lse);

  const FwdArgs a = MakeFwdArgs(q, kv, idx, topk_length, sink, o->untyped_data(),
                                lse->untyped_data(), x.B * x.T * x.H, x, scale);
  return LaunchStatus("sparse_mla_fwd", launch(a, stream));
}

ffi::Error SparseMlaFwdSplit(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                             ffi::AnyBuffer kv, ffi::AnyBuffer idx, ffi::AnyBuffer topk_length,
                             ffi::AnyBuffer sink, float scale, int32_t poison,
                             ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse,
                             ffi::Result<ffi::AnyBuffer> o_parts,
                             ffi::Result<ffi::AnyBuffer> lse_parts) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa sparse_mla_fwd_split: " + m);
  };
  Extents x{};
  std::string problem = CheckInputs(q, kv, idx, topk_length, &x);
  const auto dt = q.element_type();
  if (problem.empty()) problem = CheckOutputs(dt, x, sink, *o, *lse);
  if (!problem.empty()) return err(problem);
  const int64_t B = x.B, T = x.T, H = x.H;
  if (o_parts->element_type() != dt) return err("o_parts must have the dtype of q");
  if (lse_parts->element_type() != ffi::DataType::F32) return err("lse_parts must be float32");
  if (o_parts->dimensions().size() != 5 || o_parts->dimensions()[2] < 1)
    return err("o_parts must be [B, T, P, H, " + std::to_string(kDV) + "] with P >= 1, got " +
               Dims(o_parts->dimensions()));
  const int64_t P = o_parts->dimensions()[2];
  if (!HasDims(o_parts->dimensions(), {B, T, P, H, kDV}))
    return err("o_parts must be [B, T, P, H, " + std::to_string(kDV) + "], got " +
               Dims(o_parts->dimensions()));
  if (!HasDims(lse_parts->dimensions(), {B, T, P, H}))
    return err("lse_parts must be [B, T, P, H], got " + Dims(lse_parts->dimensions()));
  if (T * P * ((H + 63) / 64) > INT32_MAX || B * T * H > INT32_MAX)
    return err("too many (token, part, head block) CTAs for one launch");
  if (B == 0 || T == 0) return ffi::Error::Success();

  const std::string name = KernelName("pingpong_split", dt, x.D);
  const std::string combine_name =
      std::string("jax_dsa_fwd_combine_") + (dt == ffi::DataType::BF16 ? "bf16" : "f16");
  KernelTable<FwdArgs>::Launch launch = FwdSplitKernels().Find(name);
  KernelTable<CombineArgs>::Launch combine = CombineKernels().Find(combine_name);
  if (launch == nullptr || combine == nullptr)
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd_split: no kernel " +
                                (launch == nullptr ? name : combine_name) + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("sparse_mla_fwd_split", guard, FwdSplitKernels(),
                               CombineKernels());
      e.failure())
    return e;
  if (poison) {
    Poison(stream, o, lse);
    Poison(stream, o_parts, lse_parts);
  }

  const FwdArgs a = MakeFwdArgs(q, kv, idx, topk_length, sink, o_parts->untyped_data(),
                                lse_parts->untyped_data(), B * T * P * H, x, scale);
  if (ffi::Error e = LaunchStatus("sparse_mla_fwd_split", launch(a, stream)); e.failure())
    return e;
  CombineArgs c;
  c.o_parts = o_parts->untyped_data();
  c.lse_parts = lse_parts->untyped_data();
  c.sink = sink.untyped_data();
  c.o = o->untyped_data();
  c.lse = lse->untyped_data();
  c.rows_parts = B * T * P * H;
  c.n_head = H;
  c.rows = B * T * H;
  c.P = static_cast<int32_t>(P);
  c.H = static_cast<int32_t>(H);
  return LaunchStatus("sparse_mla_fwd_split (combine)", combine(c, stream));
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
  if (x.K < 1) return err("pool 1's list must have at least one entry");
  problem = CheckOutputs(q.element_type(), x, sink, *o, *lse);
  if (!problem.empty()) return err(problem);
  if (x.B == 0 || x.T == 0) return ffi::Error::Success();

  const std::string name = KernelName("two_pool", q.element_type(), x.D);
  KernelTable<Fwd2Args>::Launch launch = Fwd2Kernels().Find(name);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa sparse_mla_fwd_two_pool: no kernel " + name +
                                " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("sparse_mla_fwd_two_pool", guard, Fwd2Kernels()); e.failure())
    return e;
  if (poison) Poison(stream, o, lse);

  Fwd2Args y;
  y.a = MakeFwdArgs(q, kv, idx, topk_length, sink, o->untyped_data(), lse->untyped_data(),
                    x.B * x.T * x.H, x, scale);
  y.kv2 = kv2.untyped_data();
  y.idx2 = idx2.untyped_data();
  y.len2 = topk_length2.untyped_data();
  y.rows_kv2 = x.B * x2.S;
  y.n_idx2 = x.B * x.T * x2.K;
  y.S2 = static_cast<int32_t>(x2.S);
  y.K2 = static_cast<int32_t>(x2.K);
  return LaunchStatus("sparse_mla_fwd_two_pool", launch(y, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaFwdSplitSm90, jax_dsa::SparseMlaFwdSplit,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // sink
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("poison")
                                  .Ret<ffi::AnyBuffer>()  // o
                                  .Ret<ffi::AnyBuffer>()  // lse
                                  .Ret<ffi::AnyBuffer>()  // o_parts
                                  .Ret<ffi::AnyBuffer>(),  // lse_parts
                              {ffi::Traits::kCmdBufferCompatible});

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

JAX_DSA_EXPORT_INIT(JaxDsaInit, jax_dsa::FwdKernels(), jax_dsa::FwdSplitKernels(),
                    jax_dsa::CombineKernels(), jax_dsa::Fwd2Kernels())  // every forward kernel
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaFwdTwoPoolNumKernels, jax_dsa::Fwd2Kernels())
