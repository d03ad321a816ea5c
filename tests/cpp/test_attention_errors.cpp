// Bad input to the C++ attention API: the exception type, and a message that names the
// entry point and the argument.
#include <functional>

#include "attention_case.h"

namespace vidattn_test {
namespace {

using vidattn::AttentionOptions;
using vidattn::Device;
using vidattn::DeviceKind;

// Valid batched inputs and outputs, in fields a test can break one at a time.
struct Call {
  Problem p;
  Outputs o;
  TensorView q, k, v, out, lse, grad_out, dq, dk, dv;
  AttentionOptions options;

  explicit Call(bool varlen = false) {
    Case c;
    c.dtype = DType::kFloat32;
    c.heads_q = 4, c.heads_kv = 2, c.head_dim = 16, c.head_dim_v = 8;
    if (varlen) {
      c.varlen = true, c.q_lens = {3, 4}, c.k_lens = {5, 2};
    } else {
      c.batch = 2, c.seqlen_q = 5, c.seqlen_k = 7, c.key_mask = true, c.query_mask = true;
    }
    p = make_problem(c, 3);
    o = make_outputs(p);
    q = p.q.view(), k = p.k.view(), v = p.v.view(), grad_out = p.grad_out.view();
    out = o.out.view(), lse = o.lse.view(), dq = o.dq.view(), dk = o.dk.view(), dv = o.dv.view();
    options = p.options;
  }
  void describe() const { vidattn::describe_attention(q, k, v, options); }
  void forward() const { vidattn::attention_forward(q, k, v, out, lse, options); }
  void backward() const {
    vidattn::attention_backward(q, k, v, out, lse, grad_out, dq, dk, dv, options);
  }
};

enum class Entry { kDescribe, kForward, kBackward };

template <class Error>
void expect_error(const Call& call, Entry entry, const std::string& argument) {
  const char* fn = entry == Entry::kDescribe  ? "vidattn::describe_attention"
                   : entry == Entry::kForward ? "vidattn::attention_forward"
                                              : "vidattn::attention_backward";
  try {
    if (entry == Entry::kDescribe) call.describe();
    if (entry == Entry::kForward) call.forward();
    if (entry == Entry::kBackward) call.backward();
    ADD_FAILURE() << "no exception; expected one naming " << argument;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(fn), std::string::npos) << message;
    EXPECT_NE(message.find(argument), std::string::npos) << message;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

struct ErrorCase {
  const char* name;
  std::function<void(Call&)> breaks;
  bool type_error;  // TypeError, else ValueError
  std::string argument;
  bool varlen = false;
};

std::vector<ErrorCase> error_cases() {
  auto cuda = [](TensorView& t) { t.device = Device{DeviceKind::kCUDA, 0}; };
  std::vector<ErrorCase> cases = {
      {"q_int32", [](Call& c) { c.q.dtype = DType::kInt32; }, true, "'q'"},
      {"q_bool", [](Call& c) { c.q.dtype = DType::kBool; }, true, "'q'"},
      {"k_dtype_mismatch", [](Call& c) { c.k.dtype = DType::kFloat16; }, true, "'k'"},
      {"v_dtype_mismatch", [](Call& c) { c.v.dtype = DType::kFloat64; }, true, "'v'"},
      {"q_rank", [](Call& c) { c.q.ndim = 3; }, false, "'q'"},
      {"k_rank", [](Call& c) { c.k.ndim = 2; }, false, "'k'"},
      {"v_rank", [](Call& c) { c.v.ndim = 3; }, false, "'v'"},
      {"k_batch", [](Call& c) { c.k.shape[0] = 1, c.v.shape[0] = 1; }, false, "'k'"},
      {"v_batch", [](Call& c) { c.v.shape[0] = 1; }, false, "'v'"},
      {"v_seqlen", [](Call& c) { c.v.shape[1] = 6; }, false, "'v'"},
      {"v_heads", [](Call& c) { c.v.shape[2] = 1; }, false, "'v'"},
      {"k_head_dim", [](Call& c) { c.k.shape[3] = 8; }, false, "'k'"},
      {"hq_not_multiple_of_hkv", [](Call& c) { c.k.shape[2] = 3, c.v.shape[2] = 3; }, false,
       "must be a multiple of the number of k/v heads"},
      {"zero_heads", [](Call& c) { c.k.shape[2] = 0, c.v.shape[2] = 0; }, false,
       "at least one head"},
      {"zero_head_dim", [](Call& c) { c.v.shape[3] = 0; }, false, "head dims"},
      {"negative_size", [](Call& c) { c.q.shape[1] = -1; }, false, "'q' has a negative size"},
      {"q_last_stride", [](Call& c) { c.q.stride[3] = 2; }, false, "'q' must have a unit stride"},
      {"k_last_stride", [](Call& c) { c.k.stride[3] = 3; }, false, "'k' must have a unit stride"},
      {"v_last_stride", [](Call& c) { c.v.stride[3] = 0; }, false, "'v' must have a unit stride"},
      {"k_device", [=](Call& c) { cuda(c.k); }, false, "'k' must be on cpu"},
      {"v_device", [=](Call& c) { cuda(c.v); }, false, "'v' must be on cpu"},
      {"key_mask_dtype", [](Call& c) { c.options.key_padding_mask->dtype = DType::kInt32; },
       true, "'key_padding_mask'"},
      {"key_mask_shape", [](Call& c) { c.options.key_padding_mask->shape[1] = 6; }, false,
       "'key_padding_mask'"},
      {"key_mask_batch", [](Call& c) { c.options.key_padding_mask->shape[0] = 1; }, false,
       "'key_padding_mask'"},
      {"key_mask_rank", [](Call& c) { c.options.key_padding_mask->ndim = 1; }, false,
       "'key_padding_mask'"},
      {"key_mask_device", [=](Call& c) { cuda(*c.options.key_padding_mask); }, false,
       "'key_padding_mask'"},
      {"query_mask_dtype",
       [](Call& c) { c.options.query_padding_mask->dtype = DType::kFloat32; }, true,
       "'query_padding_mask'"},
      {"query_mask_shape", [](Call& c) { c.options.query_padding_mask->shape[1] = 7; }, false,
       "'query_padding_mask'"},
      {"scale_nan", [](Call& c) { c.options.scale = std::nan(""); }, false, "'scale'"},
      {"scale_inf", [](Call& c) { c.options.scale = kInf; }, false, "'scale'"},
      {"num_threads", [](Call& c) { c.options.num_threads = -1; }, false, "num_threads"},
      {"only_cu_seqlens_q", [](Call& c) { c.options.cu_seqlens_q = c.q; }, false,
       "cu_seqlens_k"},
      // varlen
      {"varlen_with_masks",
       [](Call& c) { c.options.key_padding_mask = c.p.cu_q.view(); }, false, "padding masks",
       true},
      {"varlen_q_rank", [](Call& c) { c.q.ndim = 4; }, false, "'q'", true},
      {"varlen_v_tokens", [](Call& c) { c.v.shape[0] = 6; }, false, "'v'", true},
      {"cu_dtype", [](Call& c) { c.options.cu_seqlens_q->dtype = DType::kFloat32; }, true,
       "'cu_seqlens_q'", true},
      {"cu_rank", [](Call& c) { c.options.cu_seqlens_k->ndim = 2; }, false, "'cu_seqlens_k'",
       true},
      {"cu_lengths_differ", [](Call& c) { c.options.cu_seqlens_k->shape[0] = 2; }, false,
       "'cu_seqlens_k'", true},
      {"cu_empty",
       [](Call& c) { c.options.cu_seqlens_q->shape[0] = 0, c.options.cu_seqlens_k->shape[0] = 0; },
       false, "'cu_seqlens_q'", true},
      {"cu_device", [=](Call& c) { cuda(*c.options.cu_seqlens_k); }, false, "'cu_seqlens_k'",
       true},
      {"max_seqlen_negative", [](Call& c) { c.options.max_seqlen_k = -1; }, false,
       "max_seqlen", true},
  };
  return cases;
}

inline void PrintTo(const ErrorCase& e, std::ostream* os) { *os << e.name; }

class AttentionErrors : public ::testing::TestWithParam<ErrorCase> {};

// Metadata errors: describe_attention, the forward and the backward all report them.
TEST_P(AttentionErrors, RaisesAndNamesTheArgument) {
  const ErrorCase& e = GetParam();
  for (Entry entry : {Entry::kDescribe, Entry::kForward, Entry::kBackward}) {
    Call call(e.varlen);
    e.breaks(call);
    if (e.type_error)
      expect_error<vidattn::TypeError>(call, entry, e.argument);
    else
      expect_error<vidattn::ValueError>(call, entry, e.argument);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionErrors, ::testing::ValuesIn(error_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Offsets are data, checked when the kernel reads them (describe_attention cannot).
TEST(AttentionErrors, BadCuSeqlensValues) {
  struct Bad {
    std::vector<std::int64_t> cu_q, cu_k;
    std::int64_t max_q, max_k;
    std::string message;
  };
  // Valid: q lengths {3, 4} (7 rows), k lengths {5, 2} (7 rows).
  const std::vector<Bad> bad = {
      {{1, 3, 7}, {0, 5, 7}, 4, 5, "'cu_seqlens_q' must start at 0"},
      {{0, 3, 7}, {2, 5, 7}, 4, 5, "'cu_seqlens_k' must start at 0"},
      {{0, 4, 3, 7}, {0, 5, 5, 7}, 9, 9, "'cu_seqlens_q' must be non-decreasing"},
      {{0, 3, 7}, {0, 6, 5}, 9, 9, "'cu_seqlens_k' must be non-decreasing"},
      {{0, 3, 6}, {0, 5, 7}, 4, 5, "'cu_seqlens_q' must end at the number of rows (7)"},
      {{0, 3, 7}, {0, 5, 8}, 4, 5, "'cu_seqlens_k' must end at the number of rows (7)"},
      {{0, 3, 7}, {0, 5, 7}, 3, 5, "'cu_seqlens_q' has length 4, more than the max_seqlen"},
      {{0, 3, 7}, {0, 5, 7}, 4, 4, "'cu_seqlens_k' has length 5, more than the max_seqlen"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.message);
    Call call(true);
    const HostTensor cu_q = int32_tensor(b.cu_q), cu_k = int32_tensor(b.cu_k);
    call.options.cu_seqlens_q = cu_q.view(), call.options.cu_seqlens_k = cu_k.view();
    call.options.max_seqlen_q = b.max_q, call.options.max_seqlen_k = b.max_k;
    expect_error<vidattn::ValueError>(call, Entry::kForward, b.message);
    expect_error<vidattn::ValueError>(call, Entry::kBackward, b.message);
  }
}

TEST(AttentionErrors, BadOutputs) {
  struct Bad {
    const char* name;
    std::function<void(Call&)> breaks;
    bool type_error;
    Entry entry;
    std::string argument;
  };
  const std::vector<Bad> bad = {
      {"out shape", [](Call& c) { c.out.shape[3] = 16; }, false, Entry::kForward, "'out'"},
      {"out rank", [](Call& c) { c.out.ndim = 3; }, false, Entry::kForward, "'out'"},
      {"out dtype", [](Call& c) { c.out.dtype = DType::kBFloat16; }, true, Entry::kForward, "'out'"},
      {"out stride", [](Call& c) { c.out.stride[3] = 2; }, false, Entry::kForward, "'out'"},
      {"out null", [](Call& c) { c.out.data = nullptr; }, false, Entry::kForward, "'out'"},
      {"out device", [](Call& c) { c.out.device = {DeviceKind::kCUDA, 0}; }, false,
       Entry::kForward, "'out'"},
      {"lse shape", [](Call& c) { c.lse.shape[2] = 7; }, false, Entry::kForward, "'lse'"},
      {"lse dtype", [](Call& c) { c.lse.dtype = DType::kFloat64; }, true, Entry::kForward, "'lse'"},
      {"q null", [](Call& c) { c.q.data = nullptr; }, false, Entry::kForward, "'q'"},
      {"mask null", [](Call& c) { c.options.key_padding_mask->data = nullptr; }, false,
       Entry::kForward, "'key_padding_mask'"},
      {"grad_out shape", [](Call& c) { c.grad_out.shape[1] = 4; }, false, Entry::kBackward,
       "'grad_out'"},
      {"grad_out dtype", [](Call& c) { c.grad_out.dtype = DType::kFloat16; }, true,
       Entry::kBackward, "'grad_out'"},
      {"grad_out stride", [](Call& c) { c.grad_out.stride[3] = 2; }, false, Entry::kBackward,
       "'grad_out'"},
      {"dq shape", [](Call& c) { c.dq.shape[2] = 2; }, false, Entry::kBackward, "'dq'"},
      {"dk dtype", [](Call& c) { c.dk.dtype = DType::kFloat64; }, true, Entry::kBackward, "'dk'"},
      {"dv stride", [](Call& c) { c.dv.stride[3] = 2; }, false, Entry::kBackward, "'dv'"},
      {"dv null", [](Call& c) { c.dv.data = nullptr; }, false, Entry::kBackward, "'dv'"},
      {"lse dtype backward", [](Call& c) { c.lse.dtype = DType::kFloat16; }, true,
       Entry::kBackward, "'lse'"},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    Call call;
    b.breaks(call);
    if (b.type_error)
      expect_error<vidattn::TypeError>(call, b.entry, b.argument);
    else
      expect_error<vidattn::ValueError>(call, b.entry, b.argument);
  }
}

// The CPU kernels index a sequence's keys as int: 2^31 keys (a stride-0 view, so no memory
// behind it is read) raise ValueError before anything is packed.
TEST(AttentionErrors, CpuKeysPastInt32) {
  Call call;
  call.options.key_padding_mask.reset();
  for (TensorView* t : {&call.k, &call.v}) t->shape[1] = std::int64_t(1) << 31, t->stride[1] = 0;
  expect_error<vidattn::ValueError>(call, Entry::kForward, "at most 2^31 - 1 keys per sequence");
}

// Device checks compare kind and index: all-CUDA metadata is valid, cuda:0 with cuda:1 is not.
TEST(AttentionErrors, CudaTensors) {
  Call call;
  for (TensorView* t : {&call.q, &call.k, &call.v, &call.out, &call.lse,
                        &*call.options.key_padding_mask, &*call.options.query_padding_mask})
    t->device = {DeviceKind::kCUDA, 1};
  const auto problem = vidattn::describe_attention(call.q, call.k, call.v, call.options);
  EXPECT_EQ(problem.device.kind, DeviceKind::kCUDA);
  EXPECT_EQ(problem.device.index, 1);
  // A CUDA tensor on another device index is a mismatch.
  Call mixed;
  for (TensorView* t : {&mixed.q, &mixed.k, &mixed.v}) t->device = {DeviceKind::kCUDA, 0};
  mixed.v.device.index = 1;
  expect_error<vidattn::ValueError>(mixed, Entry::kDescribe, "'v' must be on cuda:0");
}

}  // namespace
}  // namespace vidattn_test
