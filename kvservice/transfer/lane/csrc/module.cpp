// The Python module (kvservice/transfer/lane/native.py builds it): the Lane's methods, numpy arrays in and
// out. The only file that includes pybind11; calls that may block on a lock the lane's threads hold
// release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>

#include "lane.h"

namespace py = pybind11;
using kvlane::Lane;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using I32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using Release = py::call_guard<py::gil_scoped_release>;

std::vector<int32_t> pages(const I32Array& a) { return std::vector<int32_t>(a.data(), a.data() + a.size()); }

void add_pool(Lane& lane, const std::string& bs, const std::string& owner, int device, int64_t num_pages, uint64_t sig,
              int rank, const U64Array& regions, uint64_t xsig) {
  if (regions.ndim() != 2 || regions.shape(1) != 3) throw std::invalid_argument("regions: want [n, 3]");
  std::vector<kvlane::RegionDesc> rs;
  auto r = regions.unchecked<2>();
  for (py::ssize_t i = 0; i < r.shape(0); ++i) rs.push_back({r(i, 0), r(i, 1), r(i, 2)});
  lane.add_pool(bs, owner, device, num_pages, sig, rank, std::move(rs), xsig);
}

// ``rows``: [n, 4] (region, offset, token stride, row bytes), geometry.row_table
bool set_rows(Lane& lane, const std::string& bs, uint64_t lsig, const U64Array& rows) {
  if (rows.ndim() != 2 || rows.shape(1) != 4) throw std::invalid_argument("rows: want [n, 4]");
  std::vector<kvlane::RowDesc> rs;
  auto r = rows.unchecked<2>();
  for (py::ssize_t i = 0; i < r.shape(0); ++i) rs.push_back({r(i, 0), r(i, 1), r(i, 2), r(i, 3)});
  return lane.set_rows(bs, lsig, std::move(rs));
}

// The receiver's page geometry for page-layout conversions (``rrows``: [n, 4] as set_rows;
// ``rpages``: each region's page bytes; empty: none)
void arm_out(Lane& lane, const std::string& tid, int rank, const std::string& address, const std::string& remote_agent,
             uint64_t raddr, uint64_t rbytes, int rdev, int rmem, uint64_t xsig, int64_t prefix, int64_t ndst,
             double deadline, uint64_t xusig, int rps, uint64_t rlsig, const U64Array& rrows, const U64Array& rpages) {
  if (rrows.ndim() != 2 || rrows.shape(1) != 4) throw std::invalid_argument("rrows: want [n, 4]");
  std::vector<kvlane::RowDesc> rs;
  auto r = rrows.unchecked<2>();
  for (py::ssize_t i = 0; i < r.shape(0); ++i) rs.push_back({r(i, 0), r(i, 1), r(i, 2), r(i, 3)});
  lane.arm_out(tid, rank, address, remote_agent, raddr, rbytes, rdev, rmem, xsig, prefix, ndst, deadline, xusig, rps,
               rlsig, std::move(rs), std::vector<uint64_t>(rpages.data(), rpages.data() + rpages.size()));
}

void set_alias(Lane& lane, const std::string& bs, int device, const U64Array& bases) {
  lane.set_alias(bs, device, std::vector<uint64_t>(bases.data(), bases.data() + bases.size()));
}

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// ``aux``: (name, rows) pairs (the receiver's declared aux rows)
std::vector<kvlane::AuxRows> aux_rows(const std::vector<std::pair<std::string, I64Array>>& aux) {
  std::vector<kvlane::AuxRows> rows;
  for (auto& [name, r] : aux) rows.push_back({name, std::vector<int64_t>(r.data(), r.data() + r.size())});
  return rows;
}

void arm(Lane& lane, const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
         int64_t prefix, const I32Array& dst, double deadline, int senders,
         const std::vector<std::pair<std::string, I64Array>>& aux) {
  lane.arm(tid, rank, recv_session, recv_bs, prefix, pages(dst), deadline, senders, aux_rows(aux));
}

void arm_in(Lane& lane, const std::string& tid, int rank, const std::string& recv_session, const std::string& recv_bs,
            const std::string& sender_agent, int64_t prefix, const I32Array& dst, uint64_t slot, uint64_t bytes,
            int device, double deadline, const std::vector<std::pair<std::string, I64Array>>& aux) {
  lane.arm_in(tid, rank, recv_session, recv_bs, sender_agent, prefix, pages(dst), slot, bytes, device, deadline,
              aux_rows(aux));
}

// ``aux``: (name, base address, row bytes, rows) of each aux region (host memory)
void set_aux(Lane& lane, const std::string& bs, const std::vector<std::tuple<std::string, uint64_t, uint64_t, int64_t>>& aux) {
  std::vector<kvlane::AuxDesc> out;
  for (auto& [name, base, row_bytes, n] : aux) out.push_back({name, base, row_bytes, n});
  lane.set_aux(bs, std::move(out));
}



py::bytes local_md(Lane& lane) {
  std::string md;
  {
    py::gil_scoped_release nogil;
    md = lane.local_md();
  }
  return py::bytes(md);
}

// Each completion as the tuple kvservice/transfer/lane/book.py reads.
py::list drain(Lane& lane) {
  py::list out;
  for (auto& c : lane.drain()) {
    py::array_t<int32_t> src(c.src.size());
    if (!c.src.empty()) std::memcpy(src.mutable_data(), c.src.data(), c.src.size() * 4);
    out.append(py::make_tuple(c.tid, c.rank, c.bs, c.sender_session, src, c.ok, c.error, c.nbytes, c.copy_us, c.flags,
                              c.told_recv, c.told_send, py::cast(c.ranks), py::cast(c.told), c.first, c.aux_rows,
                              c.kind));
  }
  return out;
}

// The CALLs read since the last take: (fd, session, seq, kind, request id, body bytes).
py::list take_calls(Lane& lane) {
  py::list out;
  for (auto& c : lane.take_calls())
    out.append(py::make_tuple(c.fd, c.session, c.seq, c.kind, c.rid, py::bytes(c.body)));
  return out;
}

// The cross-node chunks timed since the last call: (tid, side, first, npages, nbytes, (t0..t4)).
py::list take_trace(Lane& lane) {
  py::list out;
  for (auto& r : lane.take_trace())
    out.append(py::make_tuple(r.tid, r.side, r.first, r.npages, r.nbytes,
                              py::make_tuple(r.t[0], r.t[1], r.t[2], r.t[3], r.t[4])));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvservice native lane: per-transfer path without the GIL (kvservice/transfer/lane)";
  py::class_<Lane>(m, "Lane")
      .def(py::init<>())
      .def("stop", &Lane::stop, Release())
      .def("completion_fd", &Lane::completion_fd)
      .def("set_chunk", &Lane::set_chunk)
      .def("set_spin_us", &Lane::set_spin_us)
      .def("set_pull", &Lane::set_pull)
      .def(
          "init_cuda",
          [](Lane& l, const std::string& libcuda, const py::list& kernels) {
            // kernels: (cc, vec, threads, shared, params, name, cubin bytes) (kernels/aot.py);
            // none: CUDA stays off (init_cuda returns false, cuda_why says why)
            std::vector<kvlane::KernelImage> images;
            for (const py::handle& h : kernels) {
              auto t = h.cast<py::tuple>();
              kvlane::KernelImage im;
              im.cc = t[0].cast<int>(), im.vec = t[1].cast<int>();
              im.threads = t[2].cast<unsigned>(), im.shared = t[3].cast<unsigned>();
              im.params = t[4].cast<int>();
              im.name = t[5].cast<std::string>(), im.cubin = t[6].cast<std::string>();
              images.push_back(std::move(im));
            }
            py::gil_scoped_release release;
            return l.init_cuda(libcuda, images);
          },
          py::arg("libcuda"), py::arg("kernels"))
      .def("cuda_why", &Lane::cuda_why)
      .def("prepare_device", &Lane::prepare_device, Release())
      .def("add_conn", &Lane::add_conn)
      .def("drop_session", &Lane::drop_session)
      .def("conns", &Lane::conns)
      .def("conns_of", &Lane::conns_of)
      .def("add_pool", &add_pool)
      .def("set_alias", &set_alias)
      .def("drop_pool", &Lane::drop_pool, py::arg("bs"), py::arg("wait_s") = 10.0, Release())
      .def("set_guard", &Lane::set_guard)
      .def("set_heads", &Lane::set_heads)
      .def("set_units", &Lane::set_units)
      .def("set_rows", &set_rows)
      .def("set_aux", &set_aux)
      .def("arm", &arm, py::arg("tid"), py::arg("rank"), py::arg("recv_session"), py::arg("recv_bs"), py::arg("prefix"),
           py::arg("dst"), py::arg("deadline"), py::arg("senders") = 1,
           py::arg("aux") = std::vector<std::pair<std::string, I64Array>>())
      .def("disarm", &Lane::disarm, py::arg("tid"), py::arg("rank"), py::arg("cancel") = false)
      .def("forget", &Lane::forget)
      .def("abort_stream", &Lane::abort_stream)
      .def("abort_xstreams", &Lane::abort_xstreams)
      .def("armed_count", &Lane::armed_count)
      .def("drain", &drain)
      .def("take_calls", &take_calls)
      .def("set_calls", &Lane::set_calls)
      .def(
          "answer",
          [](Lane& l, int fd, const std::string& session, uint32_t seq, int32_t code, const py::bytes& msg) {
            std::string m = msg;
            py::gil_scoped_release release;
            return l.answer(fd, session, seq, code, m);
          },
          py::arg("fd"), py::arg("session"), py::arg("seq"), py::arg("code"), py::arg("msg"))
      .def("init_nixl", &Lane::init_nixl, Release())
      .def("nixl_why", &Lane::nixl_why)
      .def("add_arena", &Lane::add_arena, Release())
      .def("local_md", &local_md)
      .def("load_md", &Lane::load_md, Release())
      .def("arm_out", &arm_out)
      .def("refuse_out", &Lane::refuse_out)
      .def("disarm_out", &Lane::disarm_out)
      .def("forget_out", &Lane::forget_out)
      .def("arm_in", &arm_in, py::arg("tid"), py::arg("rank"), py::arg("recv_session"), py::arg("recv_bs"),
           py::arg("sender_agent"), py::arg("prefix"), py::arg("dst"), py::arg("slot"), py::arg("bytes"),
           py::arg("device"), py::arg("deadline"), py::arg("aux") = std::vector<std::pair<std::string, I64Array>>())
      .def("disarm_in", &Lane::disarm_in, py::arg("tid"), py::arg("rank"), py::arg("cancel") = false)
      .def("forget_in", &Lane::forget_in)
      .def("cross_count", &Lane::cross_count)
      .def("stats", &Lane::stats)
      .def("set_req_cache", &Lane::set_req_cache)
      .def("set_note_after", &Lane::set_note_after)
      .def("set_parts", &Lane::set_parts)
      .def("set_slow_unpack", &Lane::set_slow_unpack)
      .def("set_trace", &Lane::set_trace)
      .def("take_trace", &take_trace);
}
