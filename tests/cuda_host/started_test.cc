// The started allreduce of the CUDA backend (cuda/allreduce_async.cc) on 8
// host ranks: jaxcomm_allreduce_start and jaxcomm_allreduce_done called
// through XLA call frames, on the host device and loopback NCCL of
// xla_ffi/host_device/ (JAXCOMM_HOST_DEVICE). Each rank is a thread with its
// own "XLA stream"; results are compared bit for bit with the in-step
// handler (jaxcomm_allreduce) on the same inputs, and with a float64 sum.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "common/algorithm_code.h"
#include "common/codes.h"
#include "cuda/communicators.h"
#include "cuda/handlers.h"
#include "fake_xla_ffi.h"
#include "host_device/nccl.h"

namespace {

namespace cuda = jaxcomm::cuda;
namespace host = jaxcomm::host_device;
using fake_xla::Buf;
using fake_xla::CallHandler;
using fake_xla::HostContext;

constexpr int kRanks = 8;
constexpr int32_t kNonce = 0x5eed;

// Values whose float32 sums round: the order of the additions shows in the
// bits, so equal bits mean the same schedule, not just a close answer.
float Value(int rank, size_t i, int salt) {
  const uint32_t h = static_cast<uint32_t>((rank + 1) * 2654435761u + i * 40503u + salt * 97u);
  return static_cast<float>(h % 100003) / 997.0f - 50.0f;
}

uint16_t ToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One rank's input in `dtype` (F32 or BF16), as bytes.
std::vector<char> Input(XLA_FFI_DataType dtype, int rank, size_t n, int salt) {
  const size_t isz = dtype == XLA_FFI_DataType_F32 ? 4 : 2;
  std::vector<char> bytes(n * isz);
  for (size_t i = 0; i < n; ++i) {
    const float v = Value(rank, i, salt);
    if (isz == 4) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else {
      const uint16_t b = ToBf16(v);
      std::memcpy(&bytes[i * 2], &b, 2);
    }
  }
  return bytes;
}

double Element(XLA_FFI_DataType dtype, const std::vector<char>& bytes, size_t i) {
  if (dtype == XLA_FFI_DataType_F32) {
    float f;
    std::memcpy(&f, &bytes[i * 4], 4);
    return f;
  }
  uint16_t b;
  std::memcpy(&b, &bytes[i * 2], 2);
  return FromBf16(b);
}

struct Reduction {
  int64_t op_id;
  int32_t algorithm = static_cast<int32_t>(jaxcomm::Algorithm::kRing);
  int32_t nranks = kRanks, intra_size = 1, wire_dtype = -1;
  double prescale = 1.0, postscale = 1.0;
};

// A chunk mask: `nchunks` flags at `mask` (none: every element).
struct Mask {
  bool* mask = nullptr;
  int64_t nchunks = 0;
  int64_t chunk_size = 1;
};

std::string Start(HostContext& hc, XLA_FFI_DataType dtype, void* x, int64_t n, int32_t* coords,
                  int32_t* handle, Reduction r, int32_t nonce = kNonce, Mask m = {}) {
  bool none[1] = {false};
  int64_t x_dims[1] = {n}, coords_dims[1] = {2}, handle_dims[1] = {3}, mask_dims[1] = {m.nchunks};
  return CallHandler(cuda::AllReduceStartCuda, hc,
                     {Buf(dtype, x, x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims),
                      Buf(XLA_FFI_DataType_PRED, m.mask ? m.mask : none, mask_dims)},
                     {Buf(XLA_FFI_DataType_S32, handle, handle_dims)},
                     {{"algorithm", XLA_FFI_DataType_S32, &r.algorithm},
                      {"chunk_size", XLA_FFI_DataType_S64, &m.chunk_size},
                      {"intra_size", XLA_FFI_DataType_S32, &r.intra_size},
                      {"nonce", XLA_FFI_DataType_S32, &nonce},
                      {"nranks", XLA_FFI_DataType_S32, &r.nranks},
                      {"op_id", XLA_FFI_DataType_S64, &r.op_id},
                      {"postscale", XLA_FFI_DataType_F64, &r.postscale},
                      {"prescale", XLA_FFI_DataType_F64, &r.prescale},
                      {"wire_dtype", XLA_FFI_DataType_S32, &r.wire_dtype}});
}

std::string Done(HostContext& hc, int32_t* handle, XLA_FFI_DataType dtype, void* y, int64_t n,
                 int32_t* found, bool missing_ok, int32_t nonce = kNonce) {
  int64_t handle_dims[1] = {3}, y_dims[1] = {n}, found_dims[1] = {1};
  return CallHandler(cuda::AllReduceDoneCuda, hc, {Buf(XLA_FFI_DataType_S32, handle, handle_dims)},
                     {Buf(dtype, y, y_dims), Buf(XLA_FFI_DataType_S32, found, found_dims)},
                     {{"missing_ok", XLA_FFI_DataType_PRED, &missing_ok},
                      {"nonce", XLA_FFI_DataType_S32, &nonce}});
}

// The in-step handler on the same inputs, for the bits to compare with; with
// a mask, unselected chunks are zeros (what the done call writes).
std::string InStep(HostContext& hc, XLA_FFI_DataType dtype, void* x, void* y, int64_t n,
                   int32_t* coords, Reduction r, Mask m = {}) {
  bool none[1] = {false};
  int64_t x_dims[1] = {n}, coords_dims[1] = {2}, mask_dims[1] = {m.nchunks};
  int64_t chunk_size = m.chunk_size, max_chunks = 0;
  int32_t unselected = static_cast<int32_t>(jaxcomm::Unselected::kZero);
  return CallHandler(cuda::AllReduceCuda, hc,
                     {Buf(dtype, x, x_dims), Buf(XLA_FFI_DataType_S32, coords, coords_dims),
                      Buf(XLA_FFI_DataType_PRED, m.mask ? m.mask : none, mask_dims)},
                     {Buf(dtype, y, x_dims)},
                     {{"algorithm", XLA_FFI_DataType_S32, &r.algorithm},
                      {"chunk_size", XLA_FFI_DataType_S64, &chunk_size},
                      {"intra_size", XLA_FFI_DataType_S32, &r.intra_size},
                      {"max_chunks", XLA_FFI_DataType_S64, &max_chunks},
                      {"nranks", XLA_FFI_DataType_S32, &r.nranks},
                      {"op_id", XLA_FFI_DataType_S64, &r.op_id},
                      {"postscale", XLA_FFI_DataType_F64, &r.postscale},
                      {"prescale", XLA_FFI_DataType_F64, &r.prescale},
                      {"unselected", XLA_FFI_DataType_S32, &unselected},
                      {"wire_dtype", XLA_FFI_DataType_S32, &r.wire_dtype}});
}

// Runs `body(rank, hc)` on 8 threads, each with its own XLA stream and
// device first_device + rank, then drains and deletes the streams.
void OnRanks(int first_device, const std::function<void(int, HostContext&)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      HostContext hc{host::NewStream(), first_device + r};
      body(r, hc);
      cudaStreamSynchronize(hc.stream);
      host::DeleteStream(hc.stream);
    });
  }
  for (auto& t : threads) t.join();
}

void Report(const std::string& what, int rank, const std::string& err) {
  if (err.empty()) return;
  std::lock_guard<std::mutex> lock(print_mu);
  std::cout << what << ": rank " << rank << ": " << err << "\n";
}

bool Contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Start, then done in a later "execution", against the in-step handler and
// a float64 sum. x is written on XLA's stream after a delay (so the start
// must wait for XLA's stream), and overwritten on XLA's stream right after
// the start returns (so the start must have copied it first). Devices
// first_device + r; the in-step handler runs on devices 40 + r, its own
// communicators, once the started exchange is done.
void CheckMatchesInStep(XLA_FFI_DataType dtype, size_t n, int64_t op_id, int first_device,
                        Mask m = {}) {
  const size_t isz = dtype == XLA_FFI_DataType_F32 ? 4 : 2;
  std::vector<std::vector<char>> started(kRanks), in_step(kRanks);
  std::vector<std::vector<char>> inputs(kRanks);
  for (int r = 0; r < kRanks; ++r) inputs[r] = Input(dtype, r, n, static_cast<int>(op_id));
  OnRanks(first_device, [&](int r, HostContext& hc) {
    std::vector<char> x(n * isz, 0), y(n * isz, 0x7f);
    int32_t coords[2] = {0, r}, handle[3] = {-1, -1, -1}, found = -1;
    char* xp = x.data();
    const std::vector<char>& in = inputs[r];
    host::Enqueue(hc.stream, [xp, &in] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::memcpy(xp, in.data(), in.size());
    });
    const std::string s = Start(hc, dtype, x.data(), n, coords, handle, {op_id}, kNonce, m);
    host::Enqueue(hc.stream, [xp, bytes = x.size()] { std::memset(xp, 0x55, bytes); });
    Report("start", r, s);
    CHECK(s.empty());
    cudaStreamSynchronize(hc.stream);
    CHECK(handle[0] == kNonce && handle[1] == op_id && handle[2] == 0);
    const std::string d = Done(hc, handle, dtype, y.data(), n, &found, false);
    Report("done", r, d);
    cudaStreamSynchronize(hc.stream);
    CHECK(d.empty() && found == 1);
    started[r] = y;
  });
  OnRanks(40, [&](int r, HostContext& hc) {
    std::vector<char> x = inputs[r], y(n * isz, 0x7f);
    int32_t coords[2] = {0, r};
    const std::string e = InStep(hc, dtype, x.data(), y.data(), n, coords, {op_id + 1}, m);
    Report("in-step", r, e);
    CHECK(e.empty());
    cudaStreamSynchronize(hc.stream);
    in_step[r] = y;
  });
  int differ = 0, far = 0;
  for (int r = 0; r < kRanks; ++r) {
    differ += started[r] != in_step[r];
    for (size_t i = 0; i < n; ++i) {
      double want = 0;
      const bool selected = m.mask == nullptr || m.mask[i / m.chunk_size];
      for (int q = 0; q < kRanks && selected; ++q) want += Element(dtype, inputs[q], i);
      // float32 adds at every hop, rounded to the input type.
      const double tol = (dtype == XLA_FFI_DataType_F32 ? 1e-5 : 2e-2) * (std::fabs(want) + 50);
      far += std::fabs(Element(dtype, started[r], i) - want) > tol;
    }
  }
  if (differ != 0 || far != 0) {
    std::cout << "dtype " << dtype << ": " << differ << " ranks differ from the in-step bits, "
              << far << " elements far from the float64 sum\n";
  }
  CHECK(differ == 0);
  CHECK(far == 0);
}

// A handle nobody started: an error, or with missing_ok found = 0 and y
// untouched. A wrong nonce (the attribute or the handle's) is refused and
// leaves the operation for the right done call. Every error goes back.
void CheckMissingAndNonce(int64_t op_id, int first_device) {
  constexpr size_t n = 33;
  OnRanks(first_device, [&](int r, HostContext& hc) {
    std::vector<char> x = Input(XLA_FFI_DataType_F32, r, n, 1), y(n * 4, 0x7f);
    const std::vector<char> untouched = y;
    int32_t coords[2] = {0, r}, found = -1;
    int32_t nobody[3] = {kNonce, static_cast<int32_t>(op_id) + 1000, 0};
    std::string e = Done(hc, nobody, XLA_FFI_DataType_F32, y.data(), n, &found, false);
    cudaStreamSynchronize(hc.stream);
    CHECK(Contains(e, "jaxcomm allreduce_done: no allreduce in flight on device " +
                          std::to_string(hc.device)));
    CHECK(found == 0);
    found = -1;
    e = Done(hc, nobody, XLA_FFI_DataType_F32, y.data(), n, &found, true);
    cudaStreamSynchronize(hc.stream);
    CHECK(e.empty() && found == 0 && y == untouched);

    int32_t handle[3];
    CHECK(Start(hc, XLA_FFI_DataType_F32, x.data(), n, coords, handle, {op_id}).empty());
    cudaStreamSynchronize(hc.stream);
    // Another job's nonce in the attribute, then in the handle.
    found = -1;
    e = Done(hc, handle, XLA_FFI_DataType_F32, y.data(), n, &found, false, kNonce + 1);
    cudaStreamSynchronize(hc.stream);
    CHECK(Contains(e, "this job's handles begin " + std::to_string(kNonce + 1)) && found == 0);
    int32_t forged[3] = {kNonce + 1, handle[1], handle[2]};
    found = -1;
    e = Done(hc, forged, XLA_FFI_DataType_F32, y.data(), n, &found, true);
    cudaStreamSynchronize(hc.stream);
    CHECK(e.empty() && found == 0 && y == untouched);
    // The refusals left the operation where it was: the right call finishes it.
    found = -1;
    e = Done(hc, handle, XLA_FFI_DataType_F32, y.data(), n, &found, false);
    cudaStreamSynchronize(hc.stream);
    CHECK(e.empty() && found == 1);
    int wrong = 0;
    for (size_t i = 0; i < n; ++i) {
      double want = 0;
      for (int q = 0; q < kRanks; ++q) want += Value(q, i, 1);
      float got;
      std::memcpy(&got, &y[i * 4], 4);
      wrong += std::fabs(got - want) > 1e-4 * (std::fabs(want) + 50);
    }
    CHECK(wrong == 0);
    // Each handle is finished once.
    e = Done(hc, handle, XLA_FFI_DataType_F32, y.data(), n, &found, false);
    cudaStreamSynchronize(hc.stream);
    CHECK(Contains(e, "no allreduce in flight") && found == 0);
  });
}

// Two exchanges in flight at once from one call site: sequences 0 and 1,
// each done gives its own input's sum. The second start makes no host wait
// (the first call of a site reads the coords once), XLA's stream runs on
// while the exchanges are slow, and done waits for XLA's stream once (it
// reads the handle).
void CheckTwoInFlight(int64_t op_id, int first_device) {
  constexpr size_t n = 257;
  std::vector<std::vector<char>> first(kRanks), second(kRanks);
  std::atomic<int> xla_ran_on{0};
  host::InjectedFaults().late_seconds = 0.05;  // each ring step >= 50 ms
  OnRanks(first_device, [&](int r, HostContext& hc) {
    std::vector<char> a = Input(XLA_FFI_DataType_F32, r, n, 2);
    std::vector<char> b = Input(XLA_FFI_DataType_F32, r, n, 3);
    std::vector<char> ya(n * 4, 0x7f), yb(n * 4, 0x7f);
    int32_t coords[2] = {0, r}, ha[3], hb[3], fa = -1, fb = -1;
    CHECK(Start(hc, XLA_FFI_DataType_F32, a.data(), n, coords, ha, {op_id}).empty());
    const int waits = host::HostWaits();
    CHECK(Start(hc, XLA_FFI_DataType_F32, b.data(), n, coords, hb, {op_id}).empty());
    CHECK(host::HostWaits() == waits);
    // XLA's stream is not held by the exchanges (14 ring steps, >= 0.7 s).
    std::atomic<bool> ran{false};
    const auto issued = std::chrono::steady_clock::now();
    host::Enqueue(hc.stream, [&ran] { ran = true; });
    while (!ran && std::chrono::steady_clock::now() - issued < std::chrono::milliseconds(400)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    xla_ran_on += ran ? 1 : 0;
    cudaStreamSynchronize(hc.stream);
    CHECK(ha[0] == kNonce && ha[1] == op_id && ha[2] == 0);
    CHECK(hb[0] == kNonce && hb[1] == op_id && hb[2] == 1);
    const int before = host::HostWaits();
    CHECK(Done(hc, ha, XLA_FFI_DataType_F32, ya.data(), n, &fa, false).empty());
    CHECK(host::HostWaits() == before + 1);
    CHECK(Done(hc, hb, XLA_FFI_DataType_F32, yb.data(), n, &fb, false).empty());
    cudaStreamSynchronize(hc.stream);
    CHECK(fa == 1 && fb == 1);
    first[r] = ya;
    second[r] = yb;
  });
  host::ResetFaults();
  CHECK(xla_ran_on == kRanks);
  int wrong = 0;
  for (int r = 0; r < kRanks; ++r) {
    CHECK(first[r] == first[0] && second[r] == second[0]);  // the same bits everywhere
    for (size_t i = 0; i < n; ++i) {
      double want_a = 0, want_b = 0;
      for (int q = 0; q < kRanks; ++q) {
        want_a += Value(q, i, 2);
        want_b += Value(q, i, 3);
      }
      wrong += std::fabs(Element(XLA_FFI_DataType_F32, first[r], i) - want_a) >
               1e-5 * (std::fabs(want_a) + 50);
      wrong += std::fabs(Element(XLA_FFI_DataType_F32, second[r], i) - want_b) >
               1e-5 * (std::fabs(want_b) + 50);
    }
  }
  CHECK(wrong == 0);
}

// An in-step allreduce on the same devices while a started one is in
// flight: the started one has communicators of its own (Lane::kStarted), so
// the in-step call runs beside it (one slowed exchange round, direct)
// rather than after its 14 slowed ring steps, and both sums are right.
void CheckInStepBesideStarted(int64_t op_id, int first_device) {
  constexpr size_t n = 64;
  std::atomic<int> beside{0};
  // Both sites' communicators exist before the clock runs.
  OnRanks(first_device, [&](int r, HostContext& hc) {
    std::vector<char> x = Input(XLA_FFI_DataType_F32, r, n, 4), y(n * 4);
    int32_t coords[2] = {0, r}, handle[3], found;
    Reduction direct{op_id + 1};
    direct.algorithm = static_cast<int32_t>(jaxcomm::Algorithm::kDirect);
    CHECK(InStep(hc, XLA_FFI_DataType_F32, x.data(), y.data(), n, coords, direct).empty());
    CHECK(Start(hc, XLA_FFI_DataType_F32, x.data(), n, coords, handle, {op_id}).empty());
    cudaStreamSynchronize(hc.stream);
    CHECK(Done(hc, handle, XLA_FFI_DataType_F32, y.data(), n, &found, false).empty());
    cudaStreamSynchronize(hc.stream);  // y is written there
  });
  host::InjectedFaults().late_seconds = 0.05;
  std::vector<std::vector<char>> started(kRanks), in_step(kRanks);
  OnRanks(first_device, [&](int r, HostContext& hc) {
    std::vector<char> a = Input(XLA_FFI_DataType_F32, r, n, 5);
    std::vector<char> b = Input(XLA_FFI_DataType_F32, r, n, 6);
    std::vector<char> ya(n * 4, 0x7f), yb(n * 4, 0x7f);
    int32_t coords[2] = {0, r}, handle[3], found = -1;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(Start(hc, XLA_FFI_DataType_F32, a.data(), n, coords, handle, {op_id}).empty());
    Reduction direct{op_id + 1};
    direct.algorithm = static_cast<int32_t>(jaxcomm::Algorithm::kDirect);
    CHECK(InStep(hc, XLA_FFI_DataType_F32, b.data(), yb.data(), n, coords, direct).empty());
    cudaStreamSynchronize(hc.stream);
    beside += std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(400) ? 1 : 0;
    CHECK(Done(hc, handle, XLA_FFI_DataType_F32, ya.data(), n, &found, false).empty());
    cudaStreamSynchronize(hc.stream);
    CHECK(found == 1);
    started[r] = ya;
    in_step[r] = yb;
  });
  host::ResetFaults();
  CHECK(beside == kRanks);
  int wrong = 0;
  for (int r = 0; r < kRanks; ++r) {
    for (size_t i = 0; i < n; ++i) {
      double want_a = 0, want_b = 0;
      for (int q = 0; q < kRanks; ++q) {
        want_a += Value(q, i, 5);
        want_b += Value(q, i, 6);
      }
      wrong += std::fabs(Element(XLA_FFI_DataType_F32, started[r], i) - want_a) >
               1e-5 * (std::fabs(want_a) + 50);
      wrong += std::fabs(Element(XLA_FFI_DataType_F32, in_step[r], i) - want_b) >
               1e-5 * (std::fabs(want_b) + 50);
    }
  }
  CHECK(wrong == 0);
}

// What start refuses before any rank communicates, and a done of the wrong
// size (the operation's buffers are freed, not leaked into the table).
void CheckArguments(int64_t op_id) {
  HostContext hc{host::NewStream(), 90};
  float x[4] = {1, 2, 3, 4}, y[3] = {};
  int32_t coords[2] = {0, 0}, handle[3], found = -1;
  Reduction bad{op_id};
  bad.algorithm = 7;
  CHECK(Contains(Start(hc, XLA_FFI_DataType_F32, x, 4, coords, handle, bad),
                 "jaxcomm allreduce_start: unknown algorithm code 7"));
  int32_t ints[4] = {};
  CHECK(Contains(Start(hc, XLA_FFI_DataType_S32, ints, 4, coords, handle, {op_id}),
                 "jaxcomm allreduce_start: input dtype must be"));
  CHECK(Contains(Start(hc, XLA_FFI_DataType_F32, x, 4, coords, handle, {int64_t{1} << 40}),
                 "op_id must fit in int32"));
  bool three[3] = {true, true, true};
  CHECK(Contains(
      Start(hc, XLA_FFI_DataType_F32, x, 4, coords, handle, {op_id}, kNonce, {three, 3, 2}),
      "jaxcomm allreduce_start: chunk mask has 3 entries but the input has 2 chunks"));
  // One rank alone: a group of 1.
  Reduction alone{op_id};
  alone.nranks = 1;
  CHECK(Start(hc, XLA_FFI_DataType_F32, x, 4, coords, handle, alone).empty());
  cudaStreamSynchronize(hc.stream);
  CHECK(Contains(Done(hc, handle, XLA_FFI_DataType_F32, y, 3, &found, false),
                 "the result must have the started input's size"));
  cudaStreamSynchronize(hc.stream);
  host::DeleteStream(hc.stream);
}

}  // namespace

int main() {
  cuda::SetTimeoutSeconds(30);
  CheckMatchesInStep(XLA_FFI_DataType_F32, 1000, 100, 0);
  CheckMatchesInStep(XLA_FFI_DataType_BF16, 1000, 110, 10);
  CheckMatchesInStep(XLA_FFI_DataType_F32, 3, 120, 20);  // fewer elements than ranks
  CheckMatchesInStep(XLA_FFI_DataType_F32, 0, 130, 30);  // nothing to allocate or copy
  // A chunk mask (the last chunk short): the selected chunks summed, zeros
  // between them, the in-step masked schedule's bits.
  bool mask[7] = {true, false, false, true, true, false, true};
  CheckMatchesInStep(XLA_FFI_DataType_F32, 100, 140, 0, {mask, 7, 16});
  CheckMatchesInStep(XLA_FFI_DataType_BF16, 100, 150, 10, {mask, 7, 16});
  bool nothing[7] = {};
  CheckMatchesInStep(XLA_FFI_DataType_F32, 100, 160, 20, {nothing, 7, 16});
  CheckMissingAndNonce(200, 50);
  CheckTwoInFlight(300, 60);
  CheckInStepBesideStarted(500, 70);
  CheckArguments(400);
  CHECK(fake_xla::errors_made == fake_xla::errors_destroyed);
  return Result();
}
