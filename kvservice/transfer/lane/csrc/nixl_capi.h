// NIXL's C API (libnixl_capi.so, shipped in the nixl wheels without a header), opened at run
// time like the CUDA driver: a host without NIXL builds the lane all the same, and the
// cross-node lane is then off (docs/decisions/0018).
//
// The declarations below are the functions' C ABI as NIXL 1.4-1.5 export them. Where a later
// release appended a parameter (reg_dlist_add_desc's metadata, the dlists' ``sorted``), we pass
// it: on x86-64 and aarch64 an argument a callee does not take is ignored.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <string>

namespace xnixl {

enum : int { OK = 0, IN_PROG = 1 };
enum : int { DRAM = 0, VRAM = 1 };
enum : int { WRITE = 1 };

using Agent = void*;

// nixl_capi_agent_config_t: every field zero (no progress or listener thread, no thread sync:
// the lane serialises its calls and drives progress itself) but one worker. The fields sit at
// the same offsets in the releases with and without ``num_workers`` (it fills the padding
// before the 8-byte ``pthr_delay_us``).
struct AgentConfig {
  bool enable_prog_thread = false, enable_listen_thread = false;
  int listen_port = 0;
  int thread_sync = 0;
  unsigned num_workers = 1;
  uint64_t pthr_delay_us = 0, lthr_delay_us = 0;
  bool capture_telemetry = false;
  char reserved[64] = {};  // room for fields a later release appends (read as zero)
};

struct Api {
  bool ok = false;
  std::string why;
  int (*create_agent)(const char*, Agent*) = nullptr;
  int (*create_configured_agent)(const char*, const AgentConfig*, Agent*) = nullptr;
  int (*destroy_agent)(Agent) = nullptr;
  int (*get_plugin_params)(Agent, const char*, void**, void**) = nullptr;
  int (*destroy_mem_list)(void*) = nullptr;
  int (*destroy_params)(void*) = nullptr;
  int (*create_backend)(Agent, const char*, void*, void**) = nullptr;
  int (*get_local_md)(Agent, void**, size_t*) = nullptr;
  int (*load_remote_md)(Agent, const void*, size_t, char**) = nullptr;
  int (*create_reg_dlist)(int, void**, bool) = nullptr;
  int (*destroy_reg_dlist)(void*) = nullptr;
  int (*reg_dlist_add_desc)(void*, uintptr_t, size_t, uint64_t, const void*, size_t) = nullptr;
  int (*register_mem)(Agent, void*, void*) = nullptr;
  int (*deregister_mem)(Agent, void*, void*) = nullptr;
  int (*create_xfer_dlist)(int, void**, bool) = nullptr;
  int (*destroy_xfer_dlist)(void*) = nullptr;
  int (*xfer_dlist_add_desc)(void*, uintptr_t, size_t, uint64_t) = nullptr;
  int (*create_opt_args)(void**) = nullptr;
  int (*destroy_opt_args)(void*) = nullptr;
  int (*opt_args_set_notif_msg)(void*, const void*, size_t) = nullptr;
  int (*opt_args_set_has_notif)(void*, bool) = nullptr;
  int (*create_xfer_req)(Agent, int, void*, void*, const char*, void**, void*) = nullptr;
  int (*post_xfer_req)(Agent, void*, void*) = nullptr;
  int (*get_xfer_status)(Agent, void*) = nullptr;
  int (*release_xfer_req)(Agent, void*) = nullptr;
  int (*destroy_xfer_req)(void*) = nullptr;
  int (*create_notif_map)(void**) = nullptr;
  int (*destroy_notif_map)(void*) = nullptr;
  int (*get_notifs)(Agent, void*, void*) = nullptr;
  int (*notif_map_size)(void*, size_t*) = nullptr;
  int (*notif_map_get_agent_at)(void*, size_t, const char**) = nullptr;
  int (*notif_map_get_notifs_size)(void*, const char*, size_t*) = nullptr;
  int (*notif_map_get_notif)(void*, const char*, size_t, const void**, size_t*) = nullptr;
  int (*notif_map_clear)(void*) = nullptr;
  int (*gen_notif)(Agent, const char*, const void*, size_t, void*) = nullptr;

  bool load(const std::string& path) {
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!h) return fail(std::string("dlopen ") + path + ": " + dlerror());
#define XSYM(name)                                 \
  *(void**)(&name) = dlsym(h, "nixl_capi_" #name); \
  if (!name) return fail("libnixl_capi lacks nixl_capi_" #name);
    XSYM(create_agent)
    XSYM(create_configured_agent)
    XSYM(destroy_agent)
    XSYM(get_plugin_params) XSYM(destroy_mem_list) XSYM(destroy_params) XSYM(create_backend) XSYM(get_local_md)
        XSYM(load_remote_md) XSYM(create_reg_dlist) XSYM(destroy_reg_dlist) XSYM(reg_dlist_add_desc) XSYM(register_mem)
            XSYM(deregister_mem) XSYM(create_xfer_dlist) XSYM(destroy_xfer_dlist) XSYM(xfer_dlist_add_desc)
                XSYM(create_opt_args) XSYM(destroy_opt_args) XSYM(opt_args_set_notif_msg) XSYM(opt_args_set_has_notif)
                    XSYM(create_xfer_req) XSYM(post_xfer_req) XSYM(get_xfer_status) XSYM(release_xfer_req)
                        XSYM(destroy_xfer_req) XSYM(create_notif_map) XSYM(destroy_notif_map) XSYM(get_notifs)
                            XSYM(notif_map_size) XSYM(notif_map_get_agent_at) XSYM(notif_map_get_notifs_size)
                                XSYM(notif_map_get_notif) XSYM(notif_map_clear) XSYM(gen_notif)
#undef XSYM
                                    ok = true;
    return true;
  }

  bool fail(const std::string& w) {
    why = w;
    return false;
  }
};

}  // namespace xnixl
