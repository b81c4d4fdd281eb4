// A fake of XLA's FFI collectives extension (xla/ffi/api/collectives_c_api.h,
// jaxlib 0.11 on) for the host-side tests: what XLA:GPU does, as far as the
// handlers on XLA's communicators use it.
//
// In a call's Prepare stage a handler requests cliques, each named by device
// groups (flattened ids) and a communication id; the clique is the group
// that holds the calling device. Between the stages XLA acquires every
// requested clique: one communicator per device, made once and kept for later
// calls (here: the loopback NCCL's, made with its own ncclCommInitRankConfig,
// ranks of one clique sharing a unique id). In Execute the handler gets this
// device's communicator of a clique acquired for the call; XLA gives the
// device the rank of its position in the group. Requests outside Prepare,
// and gets before the cliques are acquired or of a clique never requested,
// are errors, as in XLA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fake_xla_ffi.h"
#include "host_device/nccl.h"
#include "xla/ffi/api/collectives_c_api.h"

namespace fake_xla {

using DeviceGroups = std::vector<std::vector<int64_t>>;

// One request of a Prepare stage, as the handler made it.
struct CliqueRequest {
  XLA_FFI_CollectiveGroupMode mode;
  DeviceGroups groups;
  int64_t communication_id;
};

// A clique: its devices as the group lists them, and the communication id.
using CliqueKey = std::pair<std::vector<int64_t>, int64_t>;

// How a clique numbers its ranks: XLA's way (the device's position in its
// group), or by device id, as a runtime that sorted the devices would.
enum class RankOrder { kGroupPosition, kDeviceId };

// XLA's cliques in this process, across the calls of every device.
class Cliques {
 public:
  // `device`'s communicator of the clique `key`, made on first use.
  std::string Acquire(const CliqueKey& key, int64_t device, RankOrder order, ncclComm_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    Clique& clique = cliques_[key];
    if (!clique.unique_id_made) {
      ncclGetUniqueId(&clique.id);
      clique.unique_id_made = true;
    }
    auto it = clique.comms.find(device);
    if (it != clique.comms.end()) {
      *out = it->second;
      return "";
    }
    std::vector<int64_t> ranked = key.first;
    if (order == RankOrder::kDeviceId) std::sort(ranked.begin(), ranked.end());
    const int rank =
        static_cast<int>(std::find(ranked.begin(), ranked.end(), device) - ranked.begin());
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    if (ncclCommInitRankConfig(out, static_cast<int>(ranked.size()), clique.id, rank, &config) !=
        ncclSuccess) {
      return std::string("ncclCommInitRankConfig failed: ") + ncclGetLastError(nullptr);
    }
    clique.comms[device] = *out;
    return "";
  }

  // A failed run, as XLA owns it (here the test acts for XLA): every
  // device's communicator of these cliques is aborted, so the work queued on
  // them ends, and a later run makes new ones.
  void Abort(const std::vector<CliqueKey>& keys) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const CliqueKey& key : keys) {
      auto it = cliques_.find(key);
      if (it == cliques_.end()) continue;
      for (const auto& [device, comm] : it->second.comms) ncclCommAbort(comm);
      cliques_.erase(it);
    }
  }

 private:
  struct Clique {
    ncclUniqueId id;
    bool unique_id_made = false;
    std::map<int64_t, ncclComm_t> comms;  // by device
  };
  std::mutex mu_;
  std::map<CliqueKey, Clique> cliques_;
};

// The extension XLA attaches to one handler call on one device (flattened
// id `device`): it records the Prepare stage's requests and, once Acquire
// has run, lends the acquired cliques' communicators.
class CallCollectives {
 public:
  CallCollectives(Cliques& cliques, int64_t device, RankOrder order = RankOrder::kGroupPosition)
      : cliques_(cliques), device_(device), order_(order) {
    ext_.extension_base.struct_size = XLA_FFI_Extension_STRUCT_SIZE;
    ext_.extension_base.id = {XLA_FFI_Extension_Collectives,
                              XLA_FFI_Extension_Collectives_MajorVersion,
                              XLA_FFI_Extension_Collectives_MinorVersion};
    ext_.extension_base.next = nullptr;
    ext_.state = reinterpret_cast<XLA_FFI_CollectivesState*>(this);
    ext_.request_communicator = RequestCommunicator;
    ext_.get_communicator = GetCommunicator;
#if XLA_FFI_Extension_Collectives_MinorVersion >= 2  // memory windows came in 0.2
    ext_.request_window = RequestWindow;
    ext_.get_window = GetWindow;
#endif
  }
  CallCollectives(const CallCollectives&) = delete;
  CallCollectives& operator=(const CallCollectives&) = delete;

  const XLA_FFI_Extension* extension() const { return &ext_.extension_base; }

  // Between Prepare and Execute: this device's communicator of every
  // requested clique. Returns XLA's error, "" if none.
  std::string Acquire() {
    acquired_ = true;
    for (const CliqueKey& key : keys_) {
      ncclComm_t comm = nullptr;
      if (std::string err = cliques_.Acquire(key, device_, order_, &comm); !err.empty()) {
        return err;
      }
      comms_[key] = comm;
    }
    return "";
  }

  const std::vector<CliqueRequest>& requests() const { return requests_; }
  // The cliques requested for this call, in the order of their first request.
  const std::vector<CliqueKey>& cliques() const { return keys_; }
  // This device's communicator of a clique acquired for the call, or null.
  ncclComm_t comm(const CliqueKey& key) const {
    auto it = comms_.find(key);
    return it == comms_.end() ? nullptr : it->second;
  }

 private:
  static CallCollectives& Self(const XLA_FFI_Collectives_Extension* ext) {
    return *reinterpret_cast<CallCollectives*>(ext->state);
  }

  // The clique of `device_` among `groups`, as XLA keys it.
  XLA_FFI_Error* Key(XLA_FFI_CollectiveGroupMode mode, const XLA_FFI_ReplicaGroup* groups,
                     size_t num_groups, int64_t communication_id, CliqueKey* key) const {
    if (mode != XLA_FFI_GROUP_FLATTENED_ID) {
      return MakeError(XLA_FFI_Error_Code_UNIMPLEMENTED, "the fake knows flattened ids only");
    }
    if (communication_id < 0) {
      return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "communication_id must be non-negative");
    }
    for (size_t g = 0; g < num_groups; ++g) {
      std::vector<int64_t> ids(groups[g].ids, groups[g].ids + groups[g].size);
      if (std::find(ids.begin(), ids.end(), device_) != ids.end()) {
        *key = {std::move(ids), communication_id};
        return nullptr;
      }
    }
    return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                     "device " + std::to_string(device_) + " is in none of the replica groups");
  }

  static XLA_FFI_Error* RequestCommunicator(const XLA_FFI_Collectives_Extension* ext,
                                            XLA_FFI_Communicator_Request_Args* args) {
    CallCollectives& self = Self(ext);
    if (args->struct_size < XLA_FFI_Communicator_Request_Args_STRUCT_SIZE) {
      return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "XLA_FFI_Communicator_Request_Args too small");
    }
    if (self.acquired_) {
      return MakeError(XLA_FFI_Error_Code_FAILED_PRECONDITION,
                       "communicator requests are only available during the prepare stage");
    }
    CliqueKey key;
    if (XLA_FFI_Error* err = self.Key(args->group_mode, args->groups, args->num_groups,
                                      args->communication_id, &key)) {
      return err;
    }
    CliqueRequest request{args->group_mode, {}, args->communication_id};
    for (size_t g = 0; g < args->num_groups; ++g) {
      request.groups.emplace_back(args->groups[g].ids, args->groups[g].ids + args->groups[g].size);
    }
    self.requests_.push_back(std::move(request));
    if (std::find(self.keys_.begin(), self.keys_.end(), key) == self.keys_.end()) {
      self.keys_.push_back(std::move(key));
    }
    return nullptr;
  }

  static XLA_FFI_Error* GetCommunicator(const XLA_FFI_Collectives_Extension* ext,
                                        XLA_FFI_Communicator_Get_Args* args) {
    CallCollectives& self = Self(ext);
    if (args->struct_size < XLA_FFI_Communicator_Get_Args_STRUCT_SIZE) {
      return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT,
                       "XLA_FFI_Communicator_Get_Args too small");
    }
    if (!self.acquired_) {
      return MakeError(XLA_FFI_Error_Code_FAILED_PRECONDITION,
                       "communicators are only available after cliques are acquired");
    }
    CliqueKey key;
    if (XLA_FFI_Error* err = self.Key(args->group_mode, args->groups, args->num_groups,
                                      args->communication_id, &key)) {
      return err;
    }
    auto it = self.comms_.find(key);
    if (it == self.comms_.end()) {
      return MakeError(XLA_FFI_Error_Code_NOT_FOUND, "no clique acquired for the group of device " +
                                                         std::to_string(self.device_));
    }
    args->communicator = reinterpret_cast<XLA_FFI_Communicator*>(it->second);
    return nullptr;
  }

#if XLA_FFI_Extension_Collectives_MinorVersion >= 2
  static XLA_FFI_Error* RequestWindow(const XLA_FFI_Collectives_Extension*,
                                      XLA_FFI_Window_Request_Args*) {
    return MakeError(XLA_FFI_Error_Code_UNIMPLEMENTED, "the fake has no memory windows");
  }
  static XLA_FFI_Error* GetWindow(const XLA_FFI_Collectives_Extension*, XLA_FFI_Window_Get_Args*) {
    return MakeError(XLA_FFI_Error_Code_UNIMPLEMENTED, "the fake has no memory windows");
  }
#endif

  XLA_FFI_Collectives_Extension ext_;
  Cliques& cliques_;
  const int64_t device_;
  const RankOrder order_;
  bool acquired_ = false;
  std::vector<CliqueRequest> requests_;
  std::vector<CliqueKey> keys_;
  std::map<CliqueKey, ncclComm_t> comms_;
};

// XLA_FFI_InvokeContext_FindExtension: the extension of a type attached to
// the call, or none.
inline XLA_FFI_Error* FindExtension(XLA_FFI_InvokeContext_FindExtension_Args* args) {
  HostContext* hc = FromCtx(args->ctx);
  if (hc == nullptr) return MakeError(XLA_FFI_Error_Code_INVALID_ARGUMENT, "wrong context");
  args->extension = nullptr;
  for (auto* e = static_cast<const XLA_FFI_Extension*>(hc->extensions); e != nullptr; e = e->next) {
    if (e->id.extension_type == args->extension_type) {
      args->extension = e;
      break;
    }
  }
  return nullptr;
}

// Gives the fake API (fake_xla_ffi.h) the call's extensions.
inline void InstallExtensions() { api.XLA_FFI_InvokeContext_FindExtension = FindExtension; }

}  // namespace fake_xla
