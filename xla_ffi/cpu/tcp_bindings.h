// The Python side of cpu/tcp_transport.h, shared by jaxcomm._ffi and the
// test harness jaxcomm._ffi_testing (each has its own copy of the endpoints).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu/tcp_transport.h"

namespace jaxcomm::cpu {

inline void ThrowIfError(const Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

inline void DefineTcpFunctions(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "tcp_listen",
      [](int64_t op_id, int64_t group, int rank, const std::string& host) {
        int port = 0;
        ThrowIfError(TcpListen(op_id, group, rank, host, &port));
        return port;
      },
      py::arg("op_id"), py::arg("group"), py::arg("rank"), py::arg("host"),
      "Opens the listening socket of one device-rank of call site op_id on host (an IP "
      "address); returns its port.");
  m.def(
      "tcp_set_peers",
      [](int64_t op_id, int64_t group, const std::vector<std::pair<std::string, int>>& peers) {
        std::vector<TcpAddress> addresses;
        for (const auto& [host, port] : peers) addresses.push_back({host, port});
        ThrowIfError(TcpSetPeers(op_id, group, addresses));
      },
      py::arg("op_id"), py::arg("group"), py::arg("peers"),
      "Every rank's (host, port) of one group of call site op_id, in rank order.");
  m.def("tcp_set_rank", &TcpSetRank, py::arg("op_id"), py::arg("device"), py::arg("group"),
        py::arg("rank"),
        "The [group, rank] of this process's device `device` (ordinal) at call site op_id, "
        "for calls whose coords operand has a negative group.");
  m.def("tcp_forget", &TcpForget, py::arg("op_id"), "Closes the sockets of call site op_id.");
}

}  // namespace jaxcomm::cpu
