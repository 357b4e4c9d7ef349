// rallypoint's compiled fast path for RPC messages (built by `rallypoint build-native`,
// loaded by rallypoint/rpc/_native.py; every function has a pure-Python twin that is used
// when this is not built, and tests check that both give the same results).
//
// - recv_wrap: the RecvRpcBackward node of a received message, a C++ autograd node as
//   torch's own (one input per tensor, no next edges: nothing runs past it).
// - describe / views: the per-tensor part of the lean wire form (rallypoint/rpc/_lean.py):
//   a tensor's slot header and its bytes view, and the tensors rebuilt from the headers.
// - tensor_bytes / copy_out / parse_inline: a small tensor's bytes copied into a frame, out
//   of the read buffer on receipt, and a whole buffered frame parsed (rallypoint/rpc/
//   _framing.py).
//
// Why: a distributed-autograd training step runs these once per message in processes
// whose caches went cold while the others ran; as Python (a torch.autograd.Function and
// ~15 tensor method calls per tensor) they cost 3-4x their hot time there, as C++ ~1x.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/utils/pybind.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

static_assert(std::endian::native == std::endian::little, "the lean header is little-endian");

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// Nothing runs past it: the distributed engine captures the gradients that reach it (as
// GradientEdge inputs of its local passes) and sends them to the sender; a plain local
// backward() that reaches it stops there.
struct RecvRpcBackward : public Node {
  variable_list apply(variable_list&& grads) override { return {}; }
  std::string name() const override { return "torch::distributed::autograd::RecvRpcBackward"; }
};

// The received tensors of one message that require grad, as outputs of one new node.
std::vector<at::Tensor> recv_wrap(const std::vector<at::Tensor>& raws) {
  auto node = c10::make_intrusive<RecvRpcBackward>();
  std::vector<at::Tensor> outs;
  outs.reserve(raws.size());
  for (const auto& raw : raws) {
    outs.push_back(raw.detach());
  }
  torch::autograd::set_history(outs, node);
  return outs;
}

// The dtypes of the lean form, in the order of _lean._DTYPES (their codes).
const at::ScalarType kDtypes[] = {
    at::kFloat, at::kDouble, at::kHalf,  at::kBFloat16, at::kLong,         at::kInt,
    at::kShort, at::kChar,   at::kByte, at::kBool,     at::kComplexFloat, at::kComplexDouble};
constexpr int kDtypeCount = sizeof(kDtypes) / sizeof(kDtypes[0]);
constexpr int kSlotSize = 5;  // slot (u16), dtype code (u8), requires grad (u8), ndim (u8)

int code_of(at::ScalarType dtype) {
  for (int code = 0; code < kDtypeCount; ++code) {
    if (kDtypes[code] == dtype) return code;
  }
  return -1;
}

// A tensor (exactly torch.Tensor, checked by the caller) in slot `position`: its slot
// header, its bytes (uint8 view), its data address and whether it requires grad; None
// if it cannot travel in the lean form (_lean._describe is the same in Python).
py::object describe(const at::Tensor& tensor, int64_t position) {
  if (position < 0 || position > 0xFFFF) throw std::invalid_argument("bad lean slot");
  if (!tensor.defined() || !tensor.is_cpu() || tensor.layout() != at::kStrided ||
      tensor.is_quantized() || tensor.is_nested()) {
    return py::none();
  }
  int code = code_of(tensor.scalar_type());
  if (code < 0 || tensor.is_conj() || tensor.is_neg()) return py::none();
  if (tensor.storage_offset() != 0 || !tensor.is_contiguous()) return py::none();
  size_t nbytes = tensor.nbytes();
  if (nbytes == 0 || tensor.storage().nbytes() != nbytes) return py::none();
  bool needs_grad = tensor.requires_grad();
  at::Tensor data = needs_grad ? tensor.detach() : tensor;
  int64_t ndim = data.dim();
  if (ndim > 255) return py::none();
  std::string head(kSlotSize + 8 * ndim, '\0');
  uint16_t slot = static_cast<uint16_t>(position);
  std::memcpy(&head[0], &slot, 2);
  head[2] = static_cast<char>(code);
  head[3] = static_cast<char>(needs_grad);
  head[4] = static_cast<char>(ndim);
  auto sizes = data.sizes();
  for (int64_t i = 0; i < ndim; ++i) {
    int64_t size = sizes[i];
    std::memcpy(&head[kSlotSize + 8 * i], &size, 8);
  }
  at::Tensor raw = ndim ? data.view(at::kByte) : data.view({1}).view(at::kByte);
  return py::make_tuple(py::bytes(head), raw, reinterpret_cast<uintptr_t>(tensor.data_ptr()),
                        needs_grad);
}

// The tensors of a lean frame from their slot headers at `offset` of `data`: (the offset
// after the headers, slots, tensors, indices of the tensors that require grad).
py::tuple views(const py::buffer& data, const std::vector<at::Tensor>& raws, int64_t offset) {
  py::buffer_info info = data.request();
  const char* bytes = static_cast<const char*>(info.ptr);
  int64_t size = info.size * info.itemsize;
  std::vector<int64_t> slots;
  std::vector<at::Tensor> rebuilt;
  std::vector<int64_t> grads;
  slots.reserve(raws.size());
  rebuilt.reserve(raws.size());
  for (const auto& raw : raws) {
    if (offset < 0 || offset + kSlotSize > size) throw std::invalid_argument("bad lean header (truncated)");
    uint16_t slot;
    std::memcpy(&slot, bytes + offset, 2);
    int code = static_cast<unsigned char>(bytes[offset + 2]);
    bool needs_grad = bytes[offset + 3] != 0;
    int ndim = static_cast<unsigned char>(bytes[offset + 4]);
    offset += kSlotSize;
    if (offset + 8 * ndim > size) throw std::invalid_argument("bad lean header (truncated)");
    std::vector<int64_t> dims(ndim);
    if (ndim) std::memcpy(dims.data(), bytes + offset, 8 * ndim);
    offset += 8 * ndim;
    if (code >= kDtypeCount) throw std::invalid_argument("bad lean dtype code " + std::to_string(code));
    at::Tensor tensor;
    try {
      tensor = raw.view(kDtypes[code]).view(dims);
    } catch (const c10::Error& error) {  // torch's message, without its C++ frames
      throw std::runtime_error(error.what_without_backtrace());
    }
    if (needs_grad && (tensor.is_floating_point() || tensor.is_complex())) {
      tensor.set_requires_grad(true);
      grads.push_back(static_cast<int64_t>(rebuilt.size()));
    }
    slots.push_back(slot);
    rebuilt.push_back(std::move(tensor));
  }
  return py::make_tuple(offset, slots, rebuilt, grads);
}

// A tensor's bytes, read-only, without a copy (the caller keeps the tensor alive while
// it uses them; _framing.tensor_view_py is the same).
py::memoryview tensor_bytes(const at::Tensor& raw) {
  size_t nbytes = raw.nbytes();
  if (nbytes == 0) return py::memoryview(py::bytes(""));
  if (!raw.is_cpu() || !raw.is_contiguous()) throw std::invalid_argument("not a contiguous CPU tensor");
  return py::memoryview::from_memory(raw.data_ptr(), static_cast<py::ssize_t>(nbytes), true);
}

// A new uint8 tensor holding `nbytes` bytes of `buffer` from `start` (a received tensor
// that the read buffer holds whole; _framing.copy_out_py is the same).
at::Tensor copy_out(const py::buffer& buffer, int64_t start, int64_t nbytes) {
  py::buffer_info info = buffer.request();
  int64_t size = info.size * info.itemsize;
  if (start < 0 || nbytes < 0 || start + nbytes > size) throw std::invalid_argument("bytes out of range");
  at::Tensor out = at::empty({nbytes}, at::kByte);
  if (nbytes) std::memcpy(out.data_ptr(), static_cast<const char*>(info.ptr) + start, nbytes);
  return out;
}

// A whole frame at buffer[start:end] whose tensors are all inline (rallypoint/rpc/_wire.py:
// HEADER, DESC): (the offset after it, kind byte, flags, request id, pickle bytes, tensors);
// None when it is not all buffered yet, has other tensors, or anything looks wrong (the
// Python reader then reads it, and raises its errors).
py::object parse_inline(const py::buffer& buffer, int64_t start, int64_t end) {
  constexpr int64_t kHeader = 24, kDesc = 16;
  constexpr uint64_t kMaxPickle = 1ULL << 34, kMaxTensors = 1ULL << 20;
  py::buffer_info info = buffer.request();
  int64_t size = info.size * info.itemsize;
  if (start < 0 || end > size || end - start < kHeader) return py::none();
  const char* p = static_cast<const char*>(info.ptr) + start;
  int64_t avail = end - start;
  if (p[0] != 'R' || p[1] != 'P') return py::none();
  uint8_t kind = static_cast<uint8_t>(p[2]);
  uint8_t flags = static_cast<uint8_t>(p[3]);
  uint32_t count;
  uint64_t request_id, data_size;
  std::memcpy(&count, p + 4, 4);
  std::memcpy(&request_id, p + 8, 8);
  std::memcpy(&data_size, p + 16, 8);
  if (data_size > kMaxPickle || count > kMaxTensors) return py::none();
  int64_t descs = kHeader + static_cast<int64_t>(data_size);
  int64_t offset = descs + kDesc * static_cast<int64_t>(count);
  if (offset > avail) return py::none();
  std::vector<int64_t> sizes(count);
  for (uint32_t i = 0; i < count; ++i) {
    const char* desc = p + descs + kDesc * i;
    if (desc[0] != 0) return py::none();  // not inline (shared memory, handed back)
    uint64_t nbytes;
    std::memcpy(&nbytes, desc + 8, 8);
    if (nbytes > static_cast<uint64_t>(avail - offset)) return py::none();
    sizes[i] = static_cast<int64_t>(nbytes);
    offset += sizes[i];
  }
  py::list tensors(count);
  int64_t at = descs + kDesc * static_cast<int64_t>(count);
  for (uint32_t i = 0; i < count; ++i) {
    at::Tensor out = at::empty({sizes[i]}, at::kByte);
    if (sizes[i]) std::memcpy(out.data_ptr(), p + at, sizes[i]);
    at += sizes[i];
    tensors[i] = py::cast(std::move(out));
  }
  py::bytes data(p + kHeader, static_cast<size_t>(data_size));
  return py::make_tuple(start + offset, kind, flags, request_id, data, tensors);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "rallypoint's compiled fast path for RPC messages (see rallypoint/rpc/_native.py)";
  m.def("recv_wrap", &recv_wrap, "wrap a message's received tensors in one RecvRpcBackward node");
  m.def("describe", &describe, "a tensor's lean slot header and bytes, or None");
  m.def("views", &views, "the tensors of a lean frame, rebuilt from their slot headers");
  m.def("tensor_bytes", &tensor_bytes, "a tensor's bytes as a read-only memoryview, no copy");
  m.def("copy_out", &copy_out, "a new uint8 tensor holding bytes of a buffer");
  m.def("parse_inline", &parse_inline, "a whole buffered frame whose tensors are inline, or None");
}
