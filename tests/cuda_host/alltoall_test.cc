// The allreduce handler (cuda/allreduce.cc) on N host ranks, for the cases
// tests/test_cuda_schedule_host.py lists: each rank's input is read from
// DIR/<case>.in, the handler is called as XLA calls it (twice: the second
// call must give the same bits without waiting for the device, the first
// having read the rank), and each rank's output is written to
// DIR/<case>.out, its NCCL launches in the second call to
// DIR/<case>.launches (int32), for Python to check.
//
//   alltoall_test DIR   # DIR/cases.txt: one case a line, see Case
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
#include "common/dtype.h"
#include "cuda/handlers.h"
#include "fake_xla_ffi.h"
#include "host_device/nccl.h"

namespace {

namespace cuda = jaxcomm::cuda;
namespace host = jaxcomm::host_device;
using fake_xla::Buf;
using fake_xla::CallHandler;
using fake_xla::HostContext;
using jaxcomm::DType;

// One line of cases.txt: name nranks n input wire algorithm prescale
// postscale chunk_size nchunks max_chunks unselected (names as in codes()).
struct Case {
  std::string name, input, wire, algorithm, unselected;
  int32_t nranks = 0;
  int64_t n = 0, chunk_size = 0, nchunks = 0, max_chunks = 0;
  double prescale = 1.0, postscale = 1.0;
};

template <typename E, size_t N>
int32_t CodeOf(const jaxcomm::NamedCode<E> (&table)[N], const std::string& name) {
  for (const auto& c : table) {
    if (name == c.name) return static_cast<int32_t>(c.code);
  }
  std::cout << "unknown name " << name << "\n";
  std::exit(2);
}

XLA_FFI_DataType FfiType(DType t) {
  switch (t) {
    case DType::kF32:
      return XLA_FFI_DataType_F32;
    case DType::kF16:
      return XLA_FFI_DataType_F16;
    case DType::kBF16:
      return XLA_FFI_DataType_BF16;
    case DType::kF64:
      return XLA_FFI_DataType_F64;
  }
  return XLA_FFI_DataType_INVALID;
}

std::vector<char> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

// Every rank calls the handler twice on its own thread and stream, as XLA
// runs one device per thread; `devices` is the first of the case's devices.
void RunCase(const std::string& dir, const Case& c, int64_t op_id, int devices) {
  const auto input = static_cast<DType>(CodeOf(jaxcomm::kDTypeNames, c.input));
  const size_t bytes = c.n * jaxcomm::SizeOf(input);
  const std::vector<char> in = ReadFile(dir + "/" + c.name + ".in");
  std::vector<char> mask_bytes =
      c.nchunks > 0 ? ReadFile(dir + "/" + c.name + ".mask") : std::vector<char>();
  CHECK(in.size() == bytes * c.nranks);
  CHECK(mask_bytes.size() == static_cast<size_t>(c.nchunks));
  if (in.size() != bytes * c.nranks || mask_bytes.size() != static_cast<size_t>(c.nchunks)) return;
  std::vector<char> out(bytes * c.nranks);
  std::vector<int32_t> launches(c.nranks, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < c.nranks; ++r) {
    threads.emplace_back([&, r] {
      HostContext hc{host::NewStream(), devices + r};
      std::vector<char> x(in.begin() + r * bytes, in.begin() + (r + 1) * bytes);
      std::vector<char> first(bytes + 1, 0x55), second(bytes + 1, 0x55);
      bool mask[64] = {};
      for (int64_t i = 0; i < c.nchunks && i < 64; ++i) mask[i] = mask_bytes[i] != 0;
      int32_t coords[2] = {0, r};
      int32_t algorithm = CodeOf(jaxcomm::kAlgorithmNames, c.algorithm), nranks = c.nranks,
              intra_size = 1, wire = CodeOf(jaxcomm::kDTypeNames, c.wire),
              unselected = CodeOf(jaxcomm::kUnselectedNames, c.unselected);
      int64_t chunk_size = c.chunk_size, max_chunks = c.max_chunks, id = op_id;
      double prescale = c.prescale, postscale = c.postscale;
      int64_t x_dims[1] = {c.n}, coords_dims[1] = {2}, mask_dims[1] = {c.nchunks};
      auto call = [&](std::vector<char>& y) {
        return CallHandler(
            cuda::AllReduceCuda, hc,
            {Buf(FfiType(input), x.data(), x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims),
             Buf(XLA_FFI_DataType_PRED, mask, mask_dims)},
            {Buf(FfiType(input), y.data(), x_dims)},
            {{"algorithm", XLA_FFI_DataType_S32, &algorithm},
             {"chunk_size", XLA_FFI_DataType_S64, &chunk_size},
             {"intra_size", XLA_FFI_DataType_S32, &intra_size},
             {"max_chunks", XLA_FFI_DataType_S64, &max_chunks},
             {"nranks", XLA_FFI_DataType_S32, &nranks},
             {"op_id", XLA_FFI_DataType_S64, &id},
             {"postscale", XLA_FFI_DataType_F64, &postscale},
             {"prescale", XLA_FFI_DataType_F64, &prescale},
             {"unselected", XLA_FFI_DataType_S32, &unselected},
             {"wire_dtype", XLA_FFI_DataType_S32, &wire}});
      };
      const std::string err1 = call(first);
      const int waits = host::HostWaits(), launched = host::NcclLaunches();
      const std::string err2 = call(second);
      const int waited = host::HostWaits() - waits;
      launches[r] = host::NcclLaunches() - launched;
      cudaStreamSynchronize(hc.stream);
      host::DeleteStream(hc.stream);
      if (!err1.empty() || !err2.empty()) {
        std::lock_guard<std::mutex> lock(print_mu);
        std::cout << c.name << ": rank " << r << ": " << err1 << " / " << err2 << "\n";
        ++failures;
        return;
      }
      // The handler enqueues everything: once the rank is known it never
      // waits for the device, between its NCCL launches or after them.
      CHECK(waited == 0);
      // The same bits twice, and nothing written past the output.
      CHECK(std::memcmp(first.data(), second.data(), bytes + 1) == 0);
      CHECK(first[bytes] == 0x55);
      std::memcpy(out.data() + r * bytes, first.data(), bytes);
    });
  }
  for (auto& t : threads) t.join();
  std::ofstream(dir + "/" + c.name + ".out", std::ios::binary).write(out.data(), out.size());
  std::ofstream(dir + "/" + c.name + ".launches", std::ios::binary)
      .write(reinterpret_cast<const char*>(launches.data()), launches.size() * sizeof(int32_t));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cout << "usage: alltoall_test DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::ifstream list(dir + "/cases.txt");
  std::string line;
  int64_t op_id = 1;
  int cases = 0;
  while (std::getline(list, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    Case c;
    fields >> c.name >> c.nranks >> c.n >> c.input >> c.wire >> c.algorithm >> c.prescale >>
        c.postscale >> c.chunk_size >> c.nchunks >> c.max_chunks >> c.unselected;
    CHECK(!fields.fail() && c.nchunks <= 64);
    if (fields.fail() || c.nchunks > 64) continue;
    // Each case on devices of its own: its own communicators, of its size.
    RunCase(dir, c, op_id, static_cast<int>(op_id) * 16);
    ++op_id;
    ++cases;
  }
  std::cout << cases << " cases\n";
  CHECK(cases > 0);
  return Result();
}
