// Shared pieces of the jax_dsa XLA FFI handlers: one-time module loading and its error capture,
// device switching, the input checks every op repeats, and the translation of a kernel launch's
// status.
//
// Include this first in a handler file, then "jax_dsa_kernels.h" (the generated index of the
// exported CuTe DSL kernels), whose inline module loaders report CUDA errors through
// CUTE_DSL_CUDA_ERROR_CHECK, defined here to record the first error in this translation unit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_dsa {
namespace {  // one slot per translation unit, like the exported loaders that write it

inline cudaError_t& LoadError() {
  static cudaError_t e = cudaSuccess;
  return e;
}

// Loads one handler file's kernel modules once (the exported loaders load on all devices).
// Per translation unit, like the LoadError() slot it reads.
class ModuleLoader {
 public:
  // Runs `load_all` (the file's Spec_X::load() calls) on the first call only, restoring the
  // calling thread's current device, which the loaders may change. Every call returns the
  // first CUDA error the loaders reported (LoadError()), or cudaSuccess.
  template <typename F>
  cudaError_t Load(F load_all) {
    std::call_once(once_, [&] {
      int prev = -1;
      bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
      load_all();
      if (have_prev) cudaSetDevice(prev);
      status_ = LoadError();
      cudaGetLastError();  // loading errors are reported through status_
    });
    return status_;
  }

 private:
  std::once_flag once_;
  cudaError_t status_ = cudaSuccess;
};

}  // namespace
}  // namespace jax_dsa

#define CUTE_DSL_CUDA_ERROR_CHECK(err)                                      \
  {                                                                         \
    cudaError_t e_ = (err);                                                 \
    if (e_ != cudaSuccess && jax_dsa::LoadError() == cudaSuccess)           \
      jax_dsa::LoadError() = e_;                                            \
  }

namespace jax_dsa {

namespace ffi = xla::ffi;

constexpr int64_t kDv = 512;

inline std::string Dims(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Makes `device` current for the handler's lifetime and restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int32_t device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    ok_ = prev_ == device || cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int32_t device_;
  int prev_ = -1;
  bool ok_ = false;
};

// Problem extents shared by the ops: q [B, T, H, Dqk], kv [B, S, Dqk], idx [B, T, K].
struct Extents {
  int64_t B, T, H, D, S, K;
};

// Checks q, kv, idx and topk_length (ranks, dtypes, extents, the kernels' limits). On success
// fills `x` and returns an empty string, otherwise the message for ffi::Error.
inline std::string CheckInputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& kv,
                               const ffi::AnyBuffer& idx, const ffi::AnyBuffer& topk_length,
                               Extents* x) {
  auto qd = q.dimensions(), kd = kv.dimensions(), id = idx.dimensions();
  auto ld = topk_length.dimensions();
  if (qd.size() != 4) return "q must be [B, T, H, Dqk], got " + Dims(qd);
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3];
  const auto dt = q.element_type();
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16)
    return "q must be bfloat16 or float16";
  if (kv.element_type() != dt) return "kv must have the dtype of q";
  if (idx.element_type() != ffi::DataType::S32) return "idx must be int32";
  if (topk_length.element_type() != ffi::DataType::S32) return "topk_length must be int32";
  if (D != 512 && D != 576) return "Dqk must be 512 or 576, got " + std::to_string(D);
  if (H < 1 || H > 128) return "H must be in 1..128, got " + std::to_string(H);
  if (kd.size() != 3 || kd[0] != B || kd[2] != D)
    return "kv must be [B, S, Dqk] = [" + std::to_string(B) + ", S, " + std::to_string(D) +
           "], got " + Dims(kd);
  const int64_t S = kd[1];
  if (id.size() != 3 || id[0] != B || id[1] != T) return "idx must be [B, T, K], got " + Dims(id);
  const int64_t K = id[2];
  if (K < 1) return "idx must have K >= 1";
  if (ld.size() != 2 || ld[0] != B || ld[1] != T)
    return "topk_length must be [B, T], got " + Dims(ld);
  // Kernel scalars are int32; the flattened token b * T + t is the grid's x index.
  if (B * T > INT32_MAX || S > INT32_MAX || K > INT32_MAX || B > 65535)
    return "B must be <= 65535 and B * T, S, K < 2^31";
  *x = Extents{B, T, H, D, S, K};
  return std::string();
}

// True when `buf` has exactly the extents `want`.
inline bool HasDims(ffi::AnyBuffer::Dimensions d, std::initializer_list<int64_t> want) {
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want)
    if (d[i++] != w) return false;
  return true;
}

// The ffi::Error for an exported wrapper's return code and the launch's CUDA status.
inline ffi::Error LaunchStatus(const char* op, int32_t rc) {
  cudaError_t ce = cudaGetLastError();
  if (rc != 0)
    return ffi::Error::Internal(
        std::string("jax_dsa ") + op + ": kernel wrapper returned " + std::to_string(rc) +
        (ce != cudaSuccess ? std::string(" (") + cudaGetErrorString(ce) + ")" : std::string()));
  if (ce != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_dsa ") + op + ": launch failed: " +
                                cudaGetErrorString(ce));
  return ffi::Error::Success();
}

}  // namespace jax_dsa
