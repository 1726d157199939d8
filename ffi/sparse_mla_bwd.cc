// XLA FFI handlers for the sparse MLA (DSA) backward on sm_90a.
//
// Kernels: ffi/kernels/sm90/bwd.py (exports jax_dsa_bwd_<dtype>_d<Dqk>, deterministic
// jax_dsa_bwd_det_*, grouped jax_dsa_bwd_g<G>_*; the atomic forms also as *_long, tuned for a
// dkv beyond the L2 and run when dkv is at least kLongDkvMinBytes) and
// dkv_reduce.py (jax_dsa_dkv_reduce_d<Dqk>),
// listed by ffi/build.py in JAX_DSA_BWD_SPECS / JAX_DSA_REDUCE_SPECS. Which form runs is the
// caller's choice (jax_dsa.cute.config.BwdConfig): the plain, grouped (`group` attribute) or
// deterministic handler.
//
//   args:  q [B, T, H, Dqk] bf16/f16, kv [B, S, Dqk] (dtype of q), idx [B, T, K] int32,
//          topk_length [B, T] int32, lse [B, T, H] f32, do [B, T, H, 512] (dtype of q),
//          o [B, T, H, 512] (the forward's, dtype of q), coef [B, T, H, 2] f32 (c, dlse)
//   attrs: scale (f32)
//   rets:  dq [B, T, H, Dqk] (dtype of q), dkv [B, S, Dqk] f32, delta [B, T, H] f32
//          (rowsum(do * o), for the caller's sink gradient)
//
// The two-pool handler (exports jax_dsa_bwd_two_pool_<dtype>_d<Dqk>, plain form) reads both
// pools in place: idx numbers both pools as one (pool 2's rows from S1 = kv's row count on,
// jax_dsa._core.one_list), and the gather reads each row from its own pool.
//   args:  q, kv [B, S1, Dqk], kv2 [B, S2, Dqk], idx [B, T, K], topk_length [B, T], lse, do, o,
//          sink [H] f32, dlse [B, T, H] f32
//   rets:  dq, dkv [B, S1 + S2, Dqk] f32 (pool 2's rows from S1 on), dsink [B, H] f32
// The kernel computes c from the sink and lse and adds the sink's gradient itself.
//
// The deterministic handler takes three more int32 args, per chunk of tokens the entries sorted
// by kv row (order, seg_end, rows; see jax_dsa.cute.deterministic.entry_order), and returns a
// fourth buffer, the fp32 workspace [chunk * K * ceil(H / 64), Dqk] whose row count sets the
// chunk. For each chunk in turn it runs the backward in store mode into the workspace, then the
// reduction that adds each kv row's run of contributions, in order, to dkv: no float atomics.

#include "common.h"  // first: defines the loaders' error hook

#include <algorithm>
#include <cstdint>
#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

// Kernel launch arguments in the kernel's flattened form. A launch covers the flattened tokens
// t_begin .. t_begin + n_tok - 1; dkv is dkv itself (rows_dkv = B * S) or, deterministic, the
// workspace.
struct BwdArgs {
  void *q, *kv, *idx, *len, *lse, *dout, *o, *coef, *dq, *dkv, *delta;
  int64_t rows_q, rows_kv, n_idx, n_tok_all, n_coef, rows_dkv;
  int32_t B, T, H, S, K, t_begin, n_tok;
  float scale;
};

struct ReduceArgs {
  void *ws, *order, *seg_end, *rows, *dkv;
  int64_t rows_ws, n, rows_kv;
  int32_t n_pos, n_hb;
};

#define JAX_DSA_BWD_SPEC(PREFIX)                                               \
  JAX_DSA_SPEC(PREFIX) {                                                       \
    static int32_t launch(const BwdArgs& a, cudaStream_t s) {                  \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                 \
      PREFIX##_Tensor_mKV_t kv{a.kv, {a.rows_kv}};                             \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                            \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok_all}};                        \
      PREFIX##_Tensor_mLse_t lse{a.lse, {a.rows_q}};                           \
      PREFIX##_Tensor_mDO_t dout{a.dout, {a.rows_q}};                          \
      PREFIX##_Tensor_mO_t o{a.o, {a.rows_q}};                                 \
      PREFIX##_Tensor_mCoef_t coef{a.coef, {a.n_coef}};                        \
      PREFIX##_Tensor_mDQ_t dq{a.dq, {a.rows_q}};                              \
      PREFIX##_Tensor_mDKV_t dkv{a.dkv, {a.rows_dkv}};                         \
      PREFIX##_Tensor_mDelta_t delta{a.delta, {a.rows_q}};                     \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &kv, &idx, &len, &lse, \
                                         &dout, &o, &coef, &dq, &dkv, &delta,  \
                                         a.B, a.T, a.H, a.S, a.K, a.t_begin,   \
                                         a.n_tok, a.scale, s);                 \
    }                                                                          \
  };
JAX_DSA_BWD_SPECS(JAX_DSA_BWD_SPEC)
#undef JAX_DSA_BWD_SPEC

struct Bwd2Args {
  BwdArgs a;  // kv = pool 1 (rows_kv = B * S1), S = S1 + S2, dkv of both; no coef, delta
  void *kv2, *sink, *dlse, *dsink;
  int64_t rows_kv2, n_head, n_bh;
  int32_t S1;
};

#define JAX_DSA_BWD2_SPEC(PREFIX)                                                   \
  JAX_DSA_SPEC(PREFIX) {                                                            \
    static int32_t launch(const Bwd2Args& x, cudaStream_t s) {                      \
      const BwdArgs& a = x.a;                                                       \
      PREFIX##_Tensor_mQ_t q{a.q, {a.rows_q}};                                      \
      PREFIX##_Tensor_mKV_t kv{a.kv, {a.rows_kv}};                                  \
      PREFIX##_Tensor_mKV2_t kv2{x.kv2, {x.rows_kv2}};                              \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                 \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok_all}};                             \
      PREFIX##_Tensor_mLse_t lse{a.lse, {a.rows_q}};                                \
      PREFIX##_Tensor_mDO_t dout{a.dout, {a.rows_q}};                               \
      PREFIX##_Tensor_mO_t o{a.o, {a.rows_q}};                                      \
      PREFIX##_Tensor_mSink_t sink{x.sink, {x.n_head}};                             \
      PREFIX##_Tensor_mDlse_t dlse{x.dlse, {a.rows_q}};                             \
      PREFIX##_Tensor_mDQ_t dq{a.dq, {a.rows_q}};                                   \
      PREFIX##_Tensor_mDKV_t dkv{a.dkv, {a.rows_dkv}};                              \
      PREFIX##_Tensor_mDsink_t dsink{x.dsink, {x.n_bh}};                            \
      return cute_dsl_##PREFIX##_wrapper(&module(), &q, &kv, &kv2, &idx, &len,      \
                                         &lse, &dout, &o, &sink, &dlse, &dq, &dkv,  \
                                         &dsink, a.B, a.T, a.H, a.S, x.S1, a.K,     \
                                         a.t_begin, a.n_tok, a.scale, s);           \
    }                                                                               \
  };
JAX_DSA_BWD2_SPECS(JAX_DSA_BWD2_SPEC)
#undef JAX_DSA_BWD2_SPEC

#define JAX_DSA_REDUCE_SPEC(PREFIX)                                               \
  JAX_DSA_SPEC(PREFIX) {                                                          \
    static int32_t launch(const ReduceArgs& a, cudaStream_t s) {                  \
      PREFIX##_Tensor_mWs_t ws{a.ws, {a.rows_ws}};                                \
      PREFIX##_Tensor_mOrder_t order{a.order, {a.n}};                             \
      PREFIX##_Tensor_mSegEnd_t seg_end{a.seg_end, {a.n}};                        \
      PREFIX##_Tensor_mRows_t rows{a.rows, {a.n}};                                \
      PREFIX##_Tensor_mDKV_t dkv{a.dkv, {a.rows_kv}};                             \
      return cute_dsl_##PREFIX##_wrapper(&module(), &ws, &order, &seg_end, &rows, \
                                         &dkv, a.n_pos, a.n_hb, s);               \
    }                                                                             \
  };
JAX_DSA_REDUCE_SPECS(JAX_DSA_REDUCE_SPEC)
#undef JAX_DSA_REDUCE_SPEC

KernelTable<BwdArgs>& BwdKernels() {
  static KernelTable<BwdArgs> table{JAX_DSA_BWD_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

KernelTable<Bwd2Args>& Bwd2Kernels() {
  static KernelTable<Bwd2Args> table{JAX_DSA_BWD2_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

KernelTable<ReduceArgs>& ReduceKernels() {
  static KernelTable<ReduceArgs> table{JAX_DSA_REDUCE_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

// Export prefix of the backward: form "" (atomic), "det_" or "g<G>_".
std::string BwdName(const std::string& form, bool bf16, int64_t d_qk) {
  return "jax_dsa_bwd_" + form + (bf16 ? "bf16" : "f16") + "_d" + std::to_string(d_qk);
}

// The kernel `name`, or its `_long` build (ffi/build.py LONG_BWD_TUNING) when the fp32 dkv
// accumulator holds at least kLongDkvMinBytes, i.e. outgrows the L2.
template <typename Args>
typename KernelTable<Args>::Launch FindAtomicBwd(KernelTable<Args>& table,
                                                 const std::string& name, size_t dkv_bytes) {
  if (static_cast<int64_t>(dkv_bytes) >= kLongDkvMinBytes) {
    if (auto launch = table.Find(name + "_long")) return launch;
  }
  return table.Find(name);
}

// Checks the buffers every backward handler shares and fills the launch arguments that do not
// depend on the mode (coef and delta: CheckBwd). Returns an error message or an empty string.
std::string CheckBwdCommon(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                           ffi::AnyBuffer topk_length, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                           ffi::AnyBuffer o, float scale, ffi::Result<ffi::AnyBuffer>& dq,
                           ffi::Result<ffi::AnyBuffer>& dkv, Extents* x, BwdArgs* a,
                           int64_t extra_rows = 0) {
  std::string problem = CheckInputs(q, kv, idx, topk_length, x);
  if (!problem.empty()) return problem;
  const int64_t B = x->B, T = x->T, H = x->H, D = x->D, S = x->S, K = x->K;
  const auto dt = q.element_type();
  if (lse.element_type() != ffi::DataType::F32) return "lse must be float32";
  if (dout.element_type() != dt) return "do must have the dtype of q";
  if (o.element_type() != dt) return "o must have the dtype of q";
  if (dq->element_type() != dt) return "dq must have the dtype of q";
  if (dkv->element_type() != ffi::DataType::F32) return "dkv must be float32";
  if (!HasDims(lse.dimensions(), {B, T, H}))
    return "lse must be [B, T, H], got " + Dims(lse.dimensions());
  if (!HasDims(dout.dimensions(), {B, T, H, kDV}))
    return "do must be [B, T, H, d_v], got " + Dims(dout.dimensions());
  if (!HasDims(o.dimensions(), {B, T, H, kDV}))
    return "o must be [B, T, H, d_v], got " + Dims(o.dimensions());
  if (!HasDims(dq->dimensions(), {B, T, H, D}))
    return "dq must be [B, T, H, Dqk], got " + Dims(dq->dimensions());
  if (!HasDims(dkv->dimensions(), {B, S + extra_rows, D}))
    return "dkv must be [B, " + std::string(extra_rows ? "S1 + S2" : "S") + ", Dqk], got " +
           Dims(dkv->dimensions());
  a->q = q.untyped_data();
  a->kv = kv.untyped_data();
  a->idx = idx.untyped_data();
  a->len = topk_length.untyped_data();
  a->lse = lse.untyped_data();
  a->dout = dout.untyped_data();
  a->o = o.untyped_data();
  a->coef = nullptr;
  a->dq = dq->untyped_data();
  a->dkv = dkv->untyped_data();
  a->delta = nullptr;
  a->rows_q = B * T * H;
  a->rows_kv = B * S;
  a->n_idx = B * T * K;
  a->n_tok_all = B * T;
  a->n_coef = 0;
  a->rows_dkv = B * (S + extra_rows);
  a->B = static_cast<int32_t>(B);
  a->T = static_cast<int32_t>(T);
  a->H = static_cast<int32_t>(H);
  a->S = static_cast<int32_t>(S);
  a->K = static_cast<int32_t>(K);
  a->t_begin = 0;
  a->n_tok = static_cast<int32_t>(B * T);
  a->scale = scale;
  return std::string();
}

// CheckBwdCommon, then coef [B, T, H, 2] and delta [B, T, H] (the one-pool handlers).
std::string CheckBwd(ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                     ffi::AnyBuffer topk_length, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                     ffi::AnyBuffer o, ffi::AnyBuffer coef, float scale,
                     ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dkv,
                     ffi::Result<ffi::AnyBuffer>& delta, Extents* x, BwdArgs* a) {
  std::string problem =
      CheckBwdCommon(q, kv, idx, topk_length, lse, dout, o, scale, dq, dkv, x, a);
  if (!problem.empty()) return problem;
  const int64_t B = x->B, T = x->T, H = x->H;
  if (coef.element_type() != ffi::DataType::F32) return "coef must be float32";
  if (delta->element_type() != ffi::DataType::F32) return "delta must be float32";
  if (!HasDims(coef.dimensions(), {B, T, H, 2}))
    return "coef must be [B, T, H, 2], got " + Dims(coef.dimensions());
  if (!HasDims(delta->dimensions(), {B, T, H}))
    return "delta must be [B, T, H], got " + Dims(delta->dimensions());
  a->coef = coef.untyped_data();
  a->delta = delta->untyped_data();
  a->n_coef = B * T * H * 2;
  return std::string();
}

// After `guard` set the device: loads every backward and reduction module (once) and zero-fills
// the fp32 dkv accumulator on XLA's stream.
ffi::Error Prepare(const char* op, const DeviceGuard& guard, cudaStream_t stream,
                   ffi::Result<ffi::AnyBuffer>& dkv) {
  if (ffi::Error e = UseDevice(op, guard, BwdKernels(), Bwd2Kernels(), ReduceKernels());
      e.failure())
    return e;
  if (dkv->size_bytes() > 0) {
    cudaError_t me = cudaMemsetAsync(dkv->untyped_data(), 0, dkv->size_bytes(), stream);
    if (me != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_dsa ") + op + ": zeroing dkv failed: " +
                                  cudaGetErrorString(me));
  }
  return ffi::Error::Success();
}

// The atomic backward of `form` ("" plain, "g<G>_" grouped; shared by both handlers).
ffi::Error RunAtomicBwd(const char* op, const std::string& form, cudaStream_t stream,
                        int32_t device, ffi::AnyBuffer q, ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                        ffi::AnyBuffer topk_length, ffi::AnyBuffer lse, ffi::AnyBuffer dout,
                        ffi::AnyBuffer o, ffi::AnyBuffer coef, float scale,
                        ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dkv,
                        ffi::Result<ffi::AnyBuffer>& delta) {
  Extents x{};
  BwdArgs a;
  std::string problem =
      CheckBwd(q, kv, idx, topk_length, lse, dout, o, coef, scale, dq, dkv, delta, &x, &a);
  if (!problem.empty()) return ffi::Error::InvalidArgument(std::string("jax_dsa ") + op + ": " + problem);
  const std::string name = BwdName(form, q.element_type() == ffi::DataType::BF16, x.D);
  KernelTable<BwdArgs>::Launch launch =
      FindAtomicBwd(BwdKernels(), name, dkv->size_bytes());
  if (launch == nullptr)
    return ffi::Error::Internal(std::string("jax_dsa ") + op + ": no kernel " + name +
                                " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = Prepare(op, guard, stream, dkv); e.failure()) return e;
  if (x.B == 0 || x.T == 0) return ffi::Error::Success();
  return LaunchStatus(op, launch(a, stream));
}

ffi::Error SparseMlaBwd(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                        ffi::AnyBuffer kv, ffi::AnyBuffer idx, ffi::AnyBuffer topk_length,
                        ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer o,
                        ffi::AnyBuffer coef, float scale, ffi::Result<ffi::AnyBuffer> dq,
                        ffi::Result<ffi::AnyBuffer> dkv, ffi::Result<ffi::AnyBuffer> delta) {
  return RunAtomicBwd("sparse_mla_bwd", "", stream, device, q, kv, idx, topk_length, lse,
                      dout, o, coef, scale, dq, dkv, delta);
}

// The grouped backward (exports jax_dsa_bwd_g<G>_*): the caller (jax_dsa.cute.kernel)
// views G consecutive tokens of 64 / G heads as one token of 64 rows (q, do, o, lse, coef, dq,
// delta as [B, T / G, 64, ...]) and passes the union of their lists with membership bits from
// bit kMemberShift up (jax_dsa.cute.grouping); same buffers as SparseMlaBwd otherwise.
ffi::Error SparseMlaBwdGrouped(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                               ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                               ffi::AnyBuffer topk_length, ffi::AnyBuffer lse,
                               ffi::AnyBuffer dout, ffi::AnyBuffer o, ffi::AnyBuffer coef,
                               float scale, int32_t group, ffi::Result<ffi::AnyBuffer> dq,
                               ffi::Result<ffi::AnyBuffer> dkv,
                               ffi::Result<ffi::AnyBuffer> delta) {
  const char* op = "sparse_mla_bwd(grouped)";
  auto qd = q.dimensions(), kd = kv.dimensions();
  bool known = false;
  for (int64_t g : kGroups) known = known || g == group;
  if (!known)
    return ffi::Error::InvalidArgument(
        "jax_dsa sparse_mla_bwd(grouped): no grouped kernel for group " + std::to_string(group));
  if (qd.size() != 4 || qd[2] != 64)
    return ffi::Error::InvalidArgument(
        "jax_dsa sparse_mla_bwd(grouped): q must be viewed as [B, T / G, 64, Dqk], got " + Dims(qd));
  if (kd.size() == 3 && kd[1] >= (int64_t{1} << kMemberShift))
    return ffi::Error::InvalidArgument(
        "jax_dsa sparse_mla_bwd(grouped): S must be < 2^" + std::to_string(kMemberShift) +
        " (membership bits above the row)");
  return RunAtomicBwd(op, "g" + std::to_string(group) + "_", stream, device, q, kv, idx, topk_length, lse,
                      dout, o, coef, scale, dq, dkv, delta);
}

// The plain backward over two pools (see the header): kv = pool 1 [B, S1, Dqk], kv2 = pool 2
// [B, S2, Dqk], idx over rows [0, S1 + S2), dkv [B, S1 + S2, Dqk].
ffi::Error SparseMlaBwdTwoPool(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                               ffi::AnyBuffer kv, ffi::AnyBuffer kv2, ffi::AnyBuffer idx,
                               ffi::AnyBuffer topk_length, ffi::AnyBuffer lse,
                               ffi::AnyBuffer dout, ffi::AnyBuffer o, ffi::AnyBuffer sink,
                               ffi::AnyBuffer dlse, float scale, ffi::Result<ffi::AnyBuffer> dq,
                               ffi::Result<ffi::AnyBuffer> dkv,
                               ffi::Result<ffi::AnyBuffer> dsink) {
  const char* op = "sparse_mla_bwd(two pools)";
  auto err = [op](const std::string& m) {
    return ffi::Error::InvalidArgument(std::string("jax_dsa ") + op + ": " + m);
  };
  auto qd = q.dimensions(), k1 = kv.dimensions(), k2 = kv2.dimensions();
  if (kv2.element_type() != q.element_type()) return err("kv2 must have the dtype of q");
  if (qd.size() != 4 || k1.size() != 3 || k2.size() != 3 || k2[0] != k1[0] || k2[2] != k1[2])
    return err("kv2 must be [B, S2, Dqk] beside kv [B, S1, Dqk], got " + Dims(k2) + " and " +
               Dims(k1));
  const int64_t s2 = k2[1];
  if (k1[1] + s2 >= (int64_t{1} << 31)) return err("S1 + S2 must be < 2^31");
  Extents x{};
  Bwd2Args y;
  BwdArgs& a = y.a;
  std::string problem =
      CheckBwdCommon(q, kv, idx, topk_length, lse, dout, o, scale, dq, dkv, &x, &a, s2);
  if (!problem.empty()) return err(problem);
  const int64_t B = x.B, T = x.T, H = x.H;
  if (sink.element_type() != ffi::DataType::F32 || !HasDims(sink.dimensions(), {H}))
    return err("sink must be float32 [H], got " + Dims(sink.dimensions()));
  if (dlse.element_type() != ffi::DataType::F32 || !HasDims(dlse.dimensions(), {B, T, H}))
    return err("dlse must be float32 [B, T, H], got " + Dims(dlse.dimensions()));
  if (dsink->element_type() != ffi::DataType::F32 || !HasDims(dsink->dimensions(), {B, H}))
    return err("dsink must be float32 [B, H], got " + Dims(dsink->dimensions()));
  a.S = static_cast<int32_t>(x.S + s2);  // rows of the list's numbering and of dkv
  y.kv2 = kv2.untyped_data();
  y.sink = sink.untyped_data();
  y.dlse = dlse.untyped_data();
  y.dsink = dsink->untyped_data();
  y.rows_kv2 = B * s2;
  y.n_head = H;
  y.n_bh = B * H;
  y.S1 = static_cast<int32_t>(x.S);
  const std::string name = BwdName("two_pool_", q.element_type() == ffi::DataType::BF16, x.D);
  KernelTable<Bwd2Args>::Launch launch =
      FindAtomicBwd(Bwd2Kernels(), name, dkv->size_bytes());
  if (launch == nullptr)
    return ffi::Error::Internal(std::string("jax_dsa ") + op + ": no kernel " + name +
                                " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = Prepare(op, guard, stream, dkv); e.failure()) return e;
  if (dsink->size_bytes() > 0) {
    cudaError_t me = cudaMemsetAsync(dsink->untyped_data(), 0, dsink->size_bytes(), stream);
    if (me != cudaSuccess)
      return ffi::Error::Internal(std::string("jax_dsa ") + op + ": zeroing dsink failed: " +
                                  cudaGetErrorString(me));
  }
  if (B == 0 || T == 0) return ffi::Error::Success();
  return LaunchStatus(op, launch(y, stream));
}

ffi::Error SparseMlaBwdDeterministic(cudaStream_t stream, int32_t device, ffi::AnyBuffer q,
                                     ffi::AnyBuffer kv, ffi::AnyBuffer idx,
                                     ffi::AnyBuffer topk_length, ffi::AnyBuffer lse,
                                     ffi::AnyBuffer dout, ffi::AnyBuffer o,
                                     ffi::AnyBuffer coef, ffi::AnyBuffer order,
                                     ffi::AnyBuffer seg_end, ffi::AnyBuffer rows, float scale,
                                     ffi::Result<ffi::AnyBuffer> dq,
                                     ffi::Result<ffi::AnyBuffer> dkv,
                                     ffi::Result<ffi::AnyBuffer> delta,
                                     ffi::Result<ffi::AnyBuffer> ws) {
  const char* op = "sparse_mla_bwd(deterministic)";
  auto err = [op](const std::string& m) {
    return ffi::Error::InvalidArgument(std::string("jax_dsa ") + op + ": " + m);
  };
  Extents x{};
  BwdArgs a;
  std::string problem =
      CheckBwd(q, kv, idx, topk_length, lse, dout, o, coef, scale, dq, dkv, delta, &x, &a);
  if (!problem.empty()) return err(problem);
  const int64_t n_hb = (x.H + 63) / 64, n_tok = x.B * x.T;
  auto wd = ws->dimensions();
  if (ws->element_type() != ffi::DataType::F32 || wd.size() != 2 || wd[1] != x.D ||
      wd[0] < x.K * n_hb || wd[0] % (x.K * n_hb) != 0)
    return err("workspace must be float32 [chunk * K * ceil(H / 64), Dqk], got " + Dims(wd));
  const int64_t chunk = wd[0] / (x.K * n_hb);
  const int64_t n_chunks = n_tok == 0 ? 0 : (n_tok + chunk - 1) / chunk;
  for (const ffi::AnyBuffer* b : {&order, &seg_end, &rows}) {
    if (b->element_type() != ffi::DataType::S32 || !HasDims(b->dimensions(), {n_chunks * chunk * x.K}))
      return err("order, seg_end and rows must be int32 [" + std::to_string(n_chunks * chunk * x.K) +
                 "] (chunks of " + std::to_string(chunk) + " tokens), got " + Dims(b->dimensions()));
  }
  if (chunk * x.K > INT32_MAX) return err("chunk * K must be < 2^31");
  const bool bf16 = q.element_type() == ffi::DataType::BF16;
  KernelTable<BwdArgs>::Launch launch = BwdKernels().Find(BwdName("det_", bf16, x.D));
  KernelTable<ReduceArgs>::Launch reduce =
      ReduceKernels().Find("jax_dsa_dkv_reduce_d" + std::to_string(x.D));
  if (launch == nullptr || reduce == nullptr)
    return ffi::Error::Internal(std::string("jax_dsa ") + op +
                                ": the deterministic kernels were not built for this dtype/Dqk");
  DeviceGuard guard(device);
  if (ffi::Error e = Prepare(op, guard, stream, dkv); e.failure()) return e;

  a.dkv = ws->untyped_data();
  a.rows_dkv = wd[0];
  ReduceArgs r;
  r.ws = ws->untyped_data();
  r.dkv = dkv->untyped_data();
  r.rows_ws = wd[0];
  r.rows_kv = x.B * x.S;
  r.n_hb = static_cast<int32_t>(n_hb);
  // Chunks run one after the other on the stream: within a chunk one warp owns each kv row.
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t t_begin = c * chunk, count = std::min(chunk, n_tok - t_begin);
    a.t_begin = static_cast<int32_t>(t_begin);
    a.n_tok = static_cast<int32_t>(count);
    if (ffi::Error e = LaunchStatus(op, launch(a, stream)); e.failure()) return e;
    const int64_t pos0 = c * chunk * x.K;
    r.order = static_cast<int32_t*>(order.untyped_data()) + pos0;
    r.seg_end = static_cast<int32_t*>(seg_end.untyped_data()) + pos0;
    r.rows = static_cast<int32_t*>(rows.untyped_data()) + pos0;
    r.n = chunk * x.K;
    r.n_pos = static_cast<int32_t>(count * x.K);
    if (ffi::Error e = LaunchStatus(op, reduce(r, stream)); e.failure()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdSm90, jax_dsa::SparseMlaBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // do
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // coef
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dkv
                                  .Ret<ffi::AnyBuffer>(),  // delta
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdGroupedSm90, jax_dsa::SparseMlaBwdGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q (viewed)
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // union entries
                                  .Arg<ffi::AnyBuffer>()  // union lengths
                                  .Arg<ffi::AnyBuffer>()  // lse (viewed)
                                  .Arg<ffi::AnyBuffer>()  // do (viewed)
                                  .Arg<ffi::AnyBuffer>()  // o (viewed)
                                  .Arg<ffi::AnyBuffer>()  // coef (viewed)
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("group")
                                  .Ret<ffi::AnyBuffer>()  // dq (viewed)
                                  .Ret<ffi::AnyBuffer>()  // dkv
                                  .Ret<ffi::AnyBuffer>(),  // delta (viewed)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdTwoPoolSm90, jax_dsa::SparseMlaBwdTwoPool,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv (pool 1)
                                  .Arg<ffi::AnyBuffer>()  // kv2 (pool 2)
                                  .Arg<ffi::AnyBuffer>()  // idx (both pools' rows)
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // do
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // sink
                                  .Arg<ffi::AnyBuffer>()  // dlse
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dkv (both pools)
                                  .Ret<ffi::AnyBuffer>(),  // dsink [B, H]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaSparseMlaBwdDeterministicSm90,
                              jax_dsa::SparseMlaBwdDeterministic,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Arg<ffi::AnyBuffer>()  // lse
                                  .Arg<ffi::AnyBuffer>()  // do
                                  .Arg<ffi::AnyBuffer>()  // o
                                  .Arg<ffi::AnyBuffer>()  // coef
                                  .Arg<ffi::AnyBuffer>()  // order
                                  .Arg<ffi::AnyBuffer>()  // seg_end
                                  .Arg<ffi::AnyBuffer>()  // rows
                                  .Attr<float>("scale")
                                  .Ret<ffi::AnyBuffer>()  // dq
                                  .Ret<ffi::AnyBuffer>()  // dkv
                                  .Ret<ffi::AnyBuffer>()  // delta
                                  .Ret<ffi::AnyBuffer>(),  // workspace
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaBwdInit, jax_dsa::BwdKernels(), jax_dsa::Bwd2Kernels(),
                    jax_dsa::ReduceKernels())  // every backward and reduction kernel
// The plain backward's specializations, and the two-pool backward's.
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaBwdNumKernels, jax_dsa::BwdKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaBwdTwoPoolNumKernels, jax_dsa::Bwd2Kernels())
