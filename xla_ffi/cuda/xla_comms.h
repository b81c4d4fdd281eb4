// XLA's own NCCL communicators, lent to our handlers by the FFI collectives
// extension (xla/ffi/api/collectives_api.h, shipped from jaxlib 0.11 on). A
// handler asks for the cliques of its device groups in XLA's Prepare stage;
// XLA creates them (or reuses those its own collectives over the same
// devices already have) before the step runs; Execute gets the ncclComm_t.
// Nothing of ours creates, caches, watches or aborts them: XLA owns their
// lifetime and failures, on one process or many, and one step never holds
// two sets of communicators over the same devices.
//
// JAXCOMM_XLA_COMMS says whether the jaxlib this was compiled against has
// the extension; without it the handlers use cuda/communicators.h. Defining
// it as 0 forces that path (tools/gpu_check.sh tests both).
#pragma once

#ifndef JAXCOMM_XLA_COMMS
#if __has_include("xla/ffi/api/collectives_api.h")
#define JAXCOMM_XLA_COMMS 1
#else
#define JAXCOMM_XLA_COMMS 0
#endif
#endif

#if JAXCOMM_XLA_COMMS

#include <cstdint>

#include "cuda/collective.h"
#include "cuda/groups.h"
#include "cuda/runtime.h"
#include "xla/ffi/api/collectives_api.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::cuda {

using XlaCommContext = xla::ffi::internal::CommunicatorContextBase<xla::ffi::internal::ErrorPolicy>;

// The extension as a handler context (.Ctx<ffi::Extension<XlaCollectives>>()).
// Minor versions only append entries after the two calls used here, so every
// 0.x from 0.1 (jaxlib 0.11) on will do; 0.12 ships 0.2.
struct XlaCollectives : xla::ffi::internal::CollectivesExtensionBase<XlaCommContext> {
  static bool Support(int32_t major, int32_t minor) { return major == 0 && minor >= 1; }
};

// BindCollectiveContexts, then XLA's communicators.
inline auto BindCollectiveContextsXlaComms() {
  return BindCollectiveContexts().Ctx<xla::ffi::Extension<XlaCollectives>>();
}

// Prepare stage of every collective handler: requests the clique of the
// call's "groups" attribute, and for algorithm=hierarchical also those of its
// intra- and inter-node sub-groups ("intra_size" ranks per node).
extern "C" XLA_FFI_Error* PrepareXlaComms(XLA_FFI_CallFrame* call_frame);

// Runs `body` on XLA's communicator for `groups` (this device's group among
// them, which XLA picks). The first call on a communicator checks, once, that
// XLA's rank order is the group order the schedules assume (reads `coords`,
// the device's [group, rank], and synchronizes `stream`).
Status RunOnXlaComms(cudaStream_t stream, int device, XlaCommContext& comms, const Groups& groups,
                     const int32_t* coords, int nranks, const CollectiveBody& body);

}  // namespace jaxcomm::cuda

#endif  // JAXCOMM_XLA_COMMS
