// The slice of ONNX Runtime's C API that the factory's kernels call (kernels/int8_kv_attention.cc, kernels/int8_matmul.cc),
// and what their operators share (shape, cpu_op, register_ops).
//
// ONNX Runtime's C API is a table of function pointers whose order is fixed (new entries are only appended) and its
// custom-operator descriptor a struct whose fields are only appended, so this header declares the entries used by
// their position instead of including the SDK's headers, which the Python wheel does not ship. The positions were read
// from onnxruntime_c_api.h (API version 29) and hold for every later version; the descriptor's layout is checked by a
// static_assert below and the whole by tests/backend/test_int8_attention.py against the installed ONNX Runtime.

#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

extern "C" {
struct OrtStatus;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtShapeInferContext;
struct OrtApi;
struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};
}

namespace ort_abi {

// The version of the API this file asks for: KernelContext_ParallelFor arrived in 1.17.
constexpr uint32_t kApiVersion = 17;

// Positions in OrtApi's table (onnxruntime_c_api.h, append-only).
enum ApiIndex : size_t {
  kCreateStatus = 0, kGetErrorMessage = 2, kCreateCustomOpDomain = 26, kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28, kGetTensorMutableData = 51, kGetTensorElementType = 60, kGetDimensionsCount = 61,
  kGetDimensions = 62, kGetTensorTypeAndShape = 65, kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86, kKernelContextGetInput = 90, kKernelContextGetOutput = 91,
  kReleaseStatus = 93, kReleaseTensorTypeAndShapeInfo = 99, kKernelContextParallelFor = 274,
};
enum : int { kOrtInvalidArgument = 2, kOrtRuntimeException = 6 };
enum : int { kFloat = 1, kInt8 = 3, kInt32 = 6 };

inline const void* const* g_api = nullptr;  // set by RegisterCustomOps

template <typename F>
F fn(size_t index) { return reinterpret_cast<F>(const_cast<void*>(g_api[index])); }

inline OrtStatus* error(int code, const std::string& message) {
  return fn<OrtStatus* (*)(int, const char*)>(kCreateStatus)(code, message.c_str());
}

// The custom-op descriptor's layout (OrtCustomOp, fields only appended), up to the fields ORT reads for version 17.
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};
static_assert(offsetof(CustomOp, CreateKernelV2) == 136 && sizeof(CustomOp) == 208, "OrtCustomOp layout");

struct Tensor {
  void* data = nullptr;
  int type = 0;
  std::vector<int64_t> dims;
  int64_t dim(size_t i) const { return i < dims.size() ? dims[i] : -1; }
};

// A tensor's dimensions as "[a, b, c]" (the kernels' error messages).
inline std::string shape(const Tensor& t) {
  std::string out = "[";
  for (size_t i = 0; i < t.dims.size(); ++i) out += (i ? ", " : "") + std::to_string(t.dims[i]);
  return out + "]";
}

// A CPU operator's descriptor with what the factory's kernels share: every input and output required and on the CPU,
// no variadic arity, versions 1 and up; the maker sets its name, input and output types (and any optional inputs).
inline CustomOp cpu_op(OrtStatus* (*create)(const CustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                       OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetExecutionProviderType = [](const CustomOp*) { return "CPUExecutionProvider"; };
  op.GetInputCharacteristic = [](const CustomOp*, size_t) { return 0; };   // required
  op.GetOutputCharacteristic = [](const CustomOp*, size_t) { return 0; };  // required
  op.GetInputMemoryType = [](const CustomOp*, size_t) { return 0; };       // default (CPU)
  op.GetVariadicInputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicInputHomogeneity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputMinArity = [](const CustomOp*) { return 1; };
  op.GetVariadicOutputHomogeneity = [](const CustomOp*) { return 1; };
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.KernelDestroy = destroy;
  op.GetStartVersion = [](const CustomOp*) { return 1; };
  op.GetEndVersion = [](const CustomOp*) { return INT_MAX; };
  return op;
}

inline OrtStatus* describe(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* s = fn<OrtStatus* (*)(const OrtValue*, OrtTensorTypeAndShapeInfo**)>(kGetTensorTypeAndShape)(value, &info)) return s;
  size_t rank = 0;
  OrtStatus* s = fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, size_t*)>(kGetDimensionsCount)(info, &rank);
  if (!s) {
    out->dims.assign(rank, 0);
    s = fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int64_t*, size_t)>(kGetDimensions)(info, out->dims.data(), rank);
  }
  if (!s) s = fn<OrtStatus* (*)(const OrtTensorTypeAndShapeInfo*, int*)>(kGetTensorElementType)(info, &out->type);
  fn<void (*)(OrtTensorTypeAndShapeInfo*)>(kReleaseTensorTypeAndShapeInfo)(info);
  if (!s) s = fn<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData)(const_cast<OrtValue*>(value), &out->data);
  return s;
}

// A library's RegisterCustomOps: the API table kept, ``domain`` made once (in ``*made``) with ``ops``, and added to
// the session's ``options``.
inline OrtStatus* register_ops(OrtSessionOptions* options, const OrtApiBase* base, const char* domain,
                               OrtCustomOpDomain** made, std::initializer_list<const CustomOp*> ops) {
  const OrtApi* api = base->GetApi(kApiVersion);
  if (!api) return nullptr;  // cannot even report: ORT older than 1.17 (the backend checks its version first)
  g_api = reinterpret_cast<const void* const*>(api);
  if (!*made) {
    if (OrtStatus* s = fn<OrtStatus* (*)(const char*, OrtCustomOpDomain**)>(kCreateCustomOpDomain)(domain, made)) return s;
    for (const CustomOp* op : ops)
      if (OrtStatus* s = fn<OrtStatus* (*)(OrtCustomOpDomain*, const CustomOp*)>(kCustomOpDomainAdd)(*made, op)) return s;
  }
  return fn<OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*)>(kAddCustomOpDomain)(options, *made);
}

}  // namespace ort_abi
