// Fault guard for engine memory mapped into the service (kvservice/buffers/guard.py).
//
// An engine owns the shared-memory segments it registers and may shrink them at any time
// (ftruncate). A page of the service's mapping past the new end then raises SIGBUS on the next
// access, in whichever thread touches it: the lane's memcpy, a torch/numpy copy on the gRPC
// route, UCX reading a source page. This handler repairs such a fault instead of letting it kill
// the service:
//
//   fault at address a, inside a guarded range [base, base + len)
//     ─▶ map anonymous zero pages over [page(a), base + len)   (MAP_FIXED: same addresses)
//     ─▶ mark the range faulted, count the fault, return       (the access is retried and succeeds)
//
// The copy that faulted completes into (or from) memory the engine no longer shares with us, so
// every transfer that touches a faulted range must end FAILED: callers check ``kvg_faulted`` /
// ``kvg_range_faulted`` after each copy (one relaxed load of ``kvg_faults`` while none happened).
// A fault outside every guarded range goes to the handler that was installed before ours
// (faulthandler, or the default action: the process dies as it would have).
//
// The table is fixed-size and lock-free: the handler reads it, Python's thread writes it.
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>

namespace {

constexpr int kSlots = 4096;

struct Slot {
  std::atomic<uint64_t> base{0};
  std::atomic<uint64_t> len{0};  // 0: free
  std::atomic<int> faulted{0};
};

Slot g_slots[kSlots];
std::atomic<uint64_t> g_faults{0};
struct sigaction g_prev;
std::atomic<bool> g_installed{false};

void on_bus(int sig, siginfo_t* si, void* uc) {
  const uint64_t a = (uint64_t)(uintptr_t)si->si_addr;
  if (si->si_code > 0) {  // raised by the kernel for an access, not sent by kill/raise
    const uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < kSlots; ++i) {
      const uint64_t len = g_slots[i].len.load(std::memory_order_acquire);
      const uint64_t base = g_slots[i].base.load(std::memory_order_relaxed);
      if (!len || a < base || a >= base + len) continue;
      const uint64_t from = a & ~(page - 1);
      void* r = mmap((void*)(uintptr_t)from, base + len - from, PROT_READ | PROT_WRITE,
                     MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (r == MAP_FAILED) break;
      g_slots[i].faulted.store(1, std::memory_order_release);
      g_faults.fetch_add(1, std::memory_order_release);
      return;
    }
  }
  // not ours: what would have happened without us
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction) return g_prev.sa_sigaction(sig, si, uc);
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN) {
    return g_prev.sa_handler(sig);
  }
  signal(sig, SIG_DFL);  // the faulting access runs again and the process ends as it would have
}

}  // namespace

extern "C" {

// Install the handler, or put it back in front when another one (faulthandler) replaced it,
// chaining to that one. 0 on success.
int kvg_install(void) {
  struct sigaction cur;
  if (sigaction(SIGBUS, nullptr, &cur) != 0) return -1;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_bus) return 0;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_bus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  g_prev = cur;
  if (sigaction(SIGBUS, &sa, nullptr) != 0) return -1;
  g_installed.store(true);
  return 0;
}

// Guard [base, base + len); the slot, or -1 when the table is full.
int kvg_add(uint64_t base, uint64_t len) {
  if (!len) return -1;
  for (int i = 0; i < kSlots; ++i) {
    uint64_t zero = 0;
    // claim a free slot: base first (invisible while len is 0), then len publishes it
    if (g_slots[i].len.load() == 0 && g_slots[i].base.compare_exchange_strong(zero, base)) {
      g_slots[i].faulted.store(0);
      g_slots[i].len.store(len, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

// The range is unmapped (or about to be): stop guarding it.
void kvg_remove(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  g_slots[slot].len.store(0, std::memory_order_release);
  g_slots[slot].faulted.store(0);
  g_slots[slot].base.store(0, std::memory_order_release);
}

int kvg_faulted(int slot) {
  if (slot < 0 || slot >= kSlots) return 0;
  return g_slots[slot].faulted.load(std::memory_order_acquire);
}

uint64_t kvg_faults(void) { return g_faults.load(std::memory_order_acquire); }

// Whether a faulted guarded range overlaps [base, base + len).
int kvg_range_faulted(uint64_t base, uint64_t len) {
  if (!g_faults.load(std::memory_order_acquire)) return 0;
  for (int i = 0; i < kSlots; ++i) {
    const uint64_t l = g_slots[i].len.load(std::memory_order_acquire);
    const uint64_t b = g_slots[i].base.load(std::memory_order_relaxed);
    if (l && g_slots[i].faulted.load() && base < b + l && b < base + len) return 1;
  }
  return 0;
}

}  // extern "C"
