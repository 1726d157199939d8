// XLA FFI handler: the union of the index lists of G consecutive tokens, for the grouped
// backward (ffi/kernels/sm90/group_union.py, exports jax_dsa_group_union_g<G>_t<TABLE>: every
// G of kGroups with every hash-table size of kUnionTables; the smallest table that holds G * K
// runs; "jax_dsa_kernels.h" lists them in JAX_DSA_UNION_SPECS).
//
//   args:  idx [B, T, K] int32, topk_length [B, T] int32
//   attrs: num_kv_rows (int64: S, entries outside [0, S) are not used), group (int32: G)
//   rets:  packed [B, T / G, G * K] int32 (row | membership bits << kMemberShift per union
//          entry, -1 after the union's length; the entries of
//          jax_dsa.cute.grouping.pack_entries(group_lists(...)) in another order),
//          length [B, T / G] int32

#include "common.h"  // first: defines the loaders' error hook

#include <string>

#include "jax_dsa_kernels.h"  // generated: includes every exported header

namespace ffi = xla::ffi;

namespace jax_dsa {
namespace {

struct UnionArgs {
  void *idx, *len, *out, *length;
  int64_t n_idx, n_tok, n_out, n_groups;
  int32_t K, S;
};

#define JAX_DSA_UNION_SPEC(PREFIX)                                                      \
  JAX_DSA_SPEC(PREFIX) {                                                                \
    static int32_t launch(const UnionArgs& a, cudaStream_t s) {                         \
      PREFIX##_Tensor_mIdx_t idx{a.idx, {a.n_idx}};                                     \
      PREFIX##_Tensor_mLen_t len{a.len, {a.n_tok}};                                     \
      PREFIX##_Tensor_mOut_t out{a.out, {a.n_out}};                                     \
      PREFIX##_Tensor_mLength_t length{a.length, {a.n_groups}};                         \
      return cute_dsl_##PREFIX##_wrapper(&module(), &idx, &len, &out, &length,          \
                                         static_cast<int32_t>(a.n_groups), a.K, a.S, s);\
    }                                                                                   \
  };
JAX_DSA_UNION_SPECS(JAX_DSA_UNION_SPEC)
#undef JAX_DSA_UNION_SPEC

KernelTable<UnionArgs>& UnionKernels() {
  static KernelTable<UnionArgs> table{JAX_DSA_UNION_SPECS(JAX_DSA_KERNEL_ENTRY)};
  return table;
}

// The union kernel of `group` with the smallest built hash table that holds group * K entries
// at a load factor <= 3/4 (clearing and scanning cost time in proportion to the table) and
// has a slot for every row (S <= table: no collisions), unless S exceeds even the largest.
// (With S = 4096 > a 2048-slot table, rows r and r + 2048 share a slot and the window's
// consecutive rows form one long probe run: the union took 0.40 ms instead of 0.08.)
KernelTable<UnionArgs>::Launch FindUnion(int32_t group, int64_t group_k, int64_t num_kv_rows) {
  constexpr int64_t kLargest = kUnionTables[sizeof(kUnionTables) / sizeof(int64_t) - 1];
  for (int64_t table : kUnionTables) {
    if (4 * group_k > 3 * table || (table < num_kv_rows && table < kLargest)) continue;
    const std::string name =
        "jax_dsa_group_union_g" + std::to_string(group) + "_t" + std::to_string(table);
    if (auto launch = UnionKernels().Find(name)) return launch;
  }
  return nullptr;
}

ffi::Error GroupUnion(cudaStream_t stream, int32_t device, ffi::AnyBuffer idx,
                      ffi::AnyBuffer topk_length, int64_t num_kv_rows, int32_t group,
                      ffi::Result<ffi::AnyBuffer> packed, ffi::Result<ffi::AnyBuffer> length) {
  auto err = [](const std::string& m) {
    return ffi::Error::InvalidArgument("jax_dsa group_union: " + m);
  };
  auto id = idx.dimensions(), ld = topk_length.dimensions();
  if (idx.element_type() != ffi::DataType::S32 || id.size() != 3)
    return err("idx must be int32 [B, T, K], got " + Dims(id));
  const int64_t B = id[0], T = id[1], K = id[2];
  if (topk_length.element_type() != ffi::DataType::S32 || !HasDims(ld, {B, T}))
    return err("topk_length must be int32 [B, T], got " + Dims(ld));
  if (group < 1 || T % group != 0)
    return err("T (" + std::to_string(T) + ") must be a multiple of group (" +
               std::to_string(group) + ")");
  if (K < 1 || group * K > kUnionCapacity)
    return err("group * K must be in 1.." + std::to_string(kUnionCapacity) + ", got " +
               std::to_string(group * K));
  if (num_kv_rows < 1 || num_kv_rows >= (int64_t{1} << kMemberShift))
    return err("num_kv_rows must be in 1..2^" + std::to_string(kMemberShift) + " - 1, got " +
               std::to_string(num_kv_rows));
  const int64_t n = T / group;
  if (packed->element_type() != ffi::DataType::S32 || !HasDims(packed->dimensions(), {B, n, group * K}))
    return err("packed must be int32 [B, T / G, G * K], got " + Dims(packed->dimensions()));
  if (length->element_type() != ffi::DataType::S32 || !HasDims(length->dimensions(), {B, n}))
    return err("length must be int32 [B, T / G], got " + Dims(length->dimensions()));
  if (B * n > INT32_MAX) return err("B * T / G must be < 2^31");
  auto launch = FindUnion(group, group * K, num_kv_rows);
  if (launch == nullptr)
    return ffi::Error::Internal("jax_dsa group_union: no kernel jax_dsa_group_union_g" +
                                std::to_string(group) + "_t* for G * K = " +
                                std::to_string(group * K) + " was built");
  DeviceGuard guard(device);
  if (ffi::Error e = UseDevice("group_union", guard, UnionKernels()); e.failure()) return e;
  if (B * n == 0) return ffi::Error::Success();
  UnionArgs a{idx.untyped_data(), topk_length.untyped_data(), packed->untyped_data(),
              length->untyped_data(), B * T * K, B * T, B * n * group * K, B * n,
              static_cast<int32_t>(K), static_cast<int32_t>(num_kv_rows)};
  return LaunchStatus("group_union", launch(a, stream));
}

}  // namespace
}  // namespace jax_dsa

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxDsaGroupUnionSm90, jax_dsa::GroupUnion,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // idx
                                  .Arg<ffi::AnyBuffer>()  // topk_length
                                  .Attr<int64_t>("num_kv_rows")
                                  .Attr<int32_t>("group")
                                  .Ret<ffi::AnyBuffer>()  // packed
                                  .Ret<ffi::AnyBuffer>(),  // length
                              {ffi::Traits::kCmdBufferCompatible});

JAX_DSA_EXPORT_INIT(JaxDsaGroupUnionInit, jax_dsa::UnionKernels())
JAX_DSA_EXPORT_NUM_KERNELS(JaxDsaGroupUnionNumKernels, jax_dsa::UnionKernels())
